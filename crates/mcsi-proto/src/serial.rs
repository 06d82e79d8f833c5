//! 32-bit serial number arithmetic (RFC 1982, used by RFC 7143 section 4.2.2.1 for CmdSN,
//! StatSN, DataSN and R2TSN).
//!
//! Two numbers exactly 2^31 apart are not ordered: neither `lt` nor `gt` holds (RFC 1982 3.2).

use std::fmt;
use std::ops::{Add, AddAssign};

/// A sequence number compared with serial arithmetic.
#[derive(Copy, Clone, Eq, PartialEq, Hash, Debug, Default)]
pub struct Sn(pub u32);

const HALF: u32 = 1 << 31;

impl Sn {
    /// `a < b` in serial arithmetic.
    pub fn lt(a: Sn, b: Sn) -> bool {
        let d = b.0.wrapping_sub(a.0);
        d != 0 && d < HALF
    }

    /// `a > b` in serial arithmetic.
    pub fn gt(a: Sn, b: Sn) -> bool {
        Sn::lt(b, a)
    }

    /// `a <= b` in serial arithmetic.
    pub fn le(a: Sn, b: Sn) -> bool {
        a == b || Sn::lt(a, b)
    }

    /// `a >= b` in serial arithmetic.
    pub fn ge(a: Sn, b: Sn) -> bool {
        a == b || Sn::gt(a, b)
    }

    /// `a - b` as a signed distance (positive when `a` is after `b`).
    pub fn diff(a: Sn, b: Sn) -> i32 {
        a.0.wrapping_sub(b.0) as i32
    }

    /// The next number.
    pub fn next(self) -> Sn {
        self + 1
    }
}

/// `exp <= sn <= max` serially: whether `sn` lies in the command window (RFC 7143 4.2.2.1).
/// An empty window (`max == exp - 1`) contains nothing.
pub fn in_window(sn: Sn, exp: Sn, max: Sn) -> bool {
    Sn::le(exp, sn) && Sn::le(sn, max)
}

impl Add<u32> for Sn {
    type Output = Sn;
    fn add(self, rhs: u32) -> Sn {
        Sn(self.0.wrapping_add(rhs))
    }
}

impl AddAssign<u32> for Sn {
    fn add_assign(&mut self, rhs: u32) {
        self.0 = self.0.wrapping_add(rhs);
    }
}

impl From<u32> for Sn {
    fn from(v: u32) -> Sn {
        Sn(v)
    }
}

impl fmt::Display for Sn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_order() {
        assert!(Sn::lt(Sn(1), Sn(2)));
        assert!(!Sn::lt(Sn(2), Sn(1)));
        assert!(!Sn::lt(Sn(5), Sn(5)));
        assert!(Sn::le(Sn(5), Sn(5)));
        assert!(Sn::ge(Sn(5), Sn(5)));
        assert!(Sn::gt(Sn(10), Sn(3)));
    }

    #[test]
    fn wrap_around() {
        // 0xffffffff + 1 wraps to 0, and 0 is after 0xffffffff.
        assert_eq!(Sn(0xffff_ffff) + 1, Sn(0));
        assert!(Sn::lt(Sn(0xffff_ffff), Sn(0)));
        assert!(Sn::gt(Sn(3), Sn(0xffff_fff0)));
        assert_eq!(Sn::diff(Sn(3), Sn(0xffff_fff0)), 19);
        assert_eq!(Sn::diff(Sn(0xffff_fff0), Sn(3)), -19);
        let mut s = Sn(0xffff_fffe);
        s += 3;
        assert_eq!(s, Sn(1));
        assert_eq!(Sn(0xffff_ffff).next(), Sn(0));
    }

    #[test]
    fn half_way_is_unordered() {
        // RFC 1982 3.2: i1 and i1 + 2^31 compare neither way.
        let a = Sn(7);
        let b = Sn(7 + (1 << 31));
        assert!(!Sn::lt(a, b) && !Sn::gt(a, b));
        assert!(!Sn::lt(b, a) && !Sn::gt(b, a));
        // One less than half way is ordered.
        assert!(Sn::lt(a, Sn(7 + (1 << 31) - 1)));
        assert!(Sn::gt(a, Sn(7 + (1 << 31) + 1)));
    }

    #[test]
    fn windows() {
        assert!(in_window(Sn(10), Sn(10), Sn(20)));
        assert!(in_window(Sn(20), Sn(10), Sn(20)));
        assert!(!in_window(Sn(21), Sn(10), Sn(20)));
        assert!(!in_window(Sn(9), Sn(10), Sn(20)));
        // Across the wrap.
        assert!(in_window(Sn(2), Sn(0xffff_fffa), Sn(5)));
        assert!(in_window(Sn(0xffff_ffff), Sn(0xffff_fffa), Sn(5)));
        assert!(!in_window(Sn(6), Sn(0xffff_fffa), Sn(5)));
        // Empty window: MaxCmdSN = ExpCmdSN - 1.
        assert!(!in_window(Sn(10), Sn(10), Sn(9)));
        assert!(!in_window(Sn(0), Sn(0), Sn(0xffff_ffff)));
        // Single-slot window.
        assert!(in_window(Sn(0), Sn(0), Sn(0)));
    }
}
