//! Asymmetric logical unit access (SPC-4 5.15): the target port groups through which a logical
//! unit is reached, each in an access state. A multipath initiator reads them with REPORT
//! TARGET PORT GROUPS and sends its I/O through the active/optimized group; a port in standby
//! or unavailable refuses media access, so an initiator that ignores the states cannot write
//! through the wrong gateway.
//!
//! mcsi reports the states and changes them when the configuration says so (implicit ALUA,
//! TPGS 01b): a group's state is what the administrator or a cluster manager sets, in every
//! gateway alike. Where the stored data keeps a record every gateway reads (an RBD image:
//! [`crate::Backend::shared_port_groups`]), the states live there ([`Stored`]): a change made
//! through one gateway reaches all, and initiators may change them too with SET TARGET PORT
//! GROUPS (explicit ALUA, TPGS 11b). Elsewhere a gateway could change only its own copy of the
//! states, so SET TARGET PORT GROUPS is refused.

use std::fmt;

/// A target port group's asymmetric access state (SPC-4 table 148).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessState {
    ActiveOptimized,
    ActiveNonOptimized,
    Standby,
    Unavailable,
}

impl AccessState {
    /// Every state and its name, as the configuration spells it.
    pub const NAMES: [(&'static str, AccessState); 4] = [
        ("active/optimized", AccessState::ActiveOptimized),
        ("active/non-optimized", AccessState::ActiveNonOptimized),
        ("standby", AccessState::Standby),
        ("unavailable", AccessState::Unavailable),
    ];

    /// Parses a configured name.
    pub fn parse(s: &str) -> Option<AccessState> {
        Self::NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|(_, a)| *a)
    }

    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, a)| *a == self)
            .map_or("?", |(n, _)| n)
    }

    /// The ASYMMETRIC ACCESS STATE field's code.
    pub fn code(self) -> u8 {
        match self {
            AccessState::ActiveOptimized => 0x0,
            AccessState::ActiveNonOptimized => 0x1,
            AccessState::Standby => 0x2,
            AccessState::Unavailable => 0x3,
        }
    }

    /// The state an ASYMMETRIC ACCESS STATE code names, among those mcsi supports (not
    /// transitioning, offline or logical block dependent).
    pub fn from_code(code: u8) -> Option<AccessState> {
        [
            AccessState::ActiveOptimized,
            AccessState::ActiveNonOptimized,
            AccessState::Standby,
            AccessState::Unavailable,
        ]
        .into_iter()
        .find(|s| s.code() == code)
    }
}

/// Who last changed a group's state: REPORT TARGET PORT GROUPS's STATUS CODE (SPC-4 table 301).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangedBy {
    /// SET TARGET PORT GROUPS (01h).
    Explicit,
    /// The target itself: its configuration, an administrator (02h).
    Implicit,
}

impl ChangedBy {
    fn code(self) -> u8 {
        match self {
            ChangedBy::Explicit => 0x01,
            ChangedBy::Implicit => 0x02,
        }
    }
    fn name(self) -> &'static str {
        match self {
            ChangedBy::Explicit => "explicit",
            ChangedBy::Implicit => "implicit",
        }
    }
}

/// The states stored with the data for every gateway to read: one line per group whose state
/// was changed since the record began, `<group id> <state> <explicit|implicit>`, after a
/// first line naming the format. Groups the record does not name keep their configured state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    pub states: std::collections::BTreeMap<u16, (AccessState, ChangedBy)>,
}

const STORED_HEADER: &str = "mcsi port group states 1";

impl Stored {
    /// Reads a record; empty bytes are an empty record (nothing changed yet). A record longer
    /// than [`MAX_GROUPS`] lines, or one this version cannot read, is an error: the gateway
    /// then keeps serving what it had.
    pub fn parse(bytes: &[u8]) -> Result<Stored, AluaError> {
        let mut out = Stored::default();
        if bytes.is_empty() {
            return Ok(out);
        }
        let text = std::str::from_utf8(bytes)
            .map_err(|_| AluaError("the stored port group states are not UTF-8".into()))?;
        let mut lines = text.lines();
        if lines.next() != Some(STORED_HEADER) {
            return Err(AluaError(format!(
                "the stored port group states do not begin with {STORED_HEADER:?}"
            )));
        }
        for (i, line) in lines.enumerate() {
            if i >= MAX_GROUPS {
                return Err(AluaError(format!(
                    "the stored port group states name more than {MAX_GROUPS} groups"
                )));
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            let parsed = match f[..] {
                [id, state, by] => {
                    id.parse::<u16>()
                        .ok()
                        .zip(AccessState::parse(state))
                        .zip(match by {
                            "explicit" => Some(ChangedBy::Explicit),
                            "implicit" => Some(ChangedBy::Implicit),
                            _ => None,
                        })
                }
                _ => None,
            };
            let Some(((id, state), by)) = parsed else {
                return Err(AluaError(format!(
                    "stored port group states, line {}: {line:?} is not `<group> <state> <explicit|implicit>`",
                    i + 2
                )));
            };
            out.states.insert(id, (state, by));
        }
        Ok(out)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = String::from(STORED_HEADER);
        s.push('\n');
        for (id, (state, by)) in &self.states {
            s.push_str(&format!("{id} {} {}\n", state.name(), by.name()));
        }
        s.into_bytes()
    }
}

impl fmt::Display for AccessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One target port group: its identifier, state, and the relative target port identifiers of
/// its ports (for iSCSI, each gateway's target portal group tag).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PortGroup {
    pub id: u16,
    pub state: AccessState,
    /// The PREF bit: a preferred group for the initiator's I/O when several are active.
    pub preferred: bool,
    pub ports: Vec<u16>,
}

/// Why a set of port groups cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AluaError(pub String);

/// The target port groups of a logical unit, checked: at least one group, identifiers unique
/// and not 0, each port in one group only, each group with at least one port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Alua {
    groups: Vec<PortGroup>,
}

/// How many groups a unit may have, and ports a group: REPORT TARGET PORT GROUPS counts a
/// group's ports in one byte, and a list this long is already far beyond a real cluster's.
pub const MAX_GROUPS: usize = 64;
pub const MAX_PORTS: usize = 255;

impl Alua {
    pub fn new(groups: Vec<PortGroup>) -> Result<Alua, AluaError> {
        if groups.is_empty() {
            return Err(AluaError("no target port group".into()));
        }
        if groups.len() > MAX_GROUPS {
            return Err(AluaError(format!(
                "{} target port groups; at most {MAX_GROUPS}",
                groups.len()
            )));
        }
        let mut ports = std::collections::BTreeMap::new();
        for (i, g) in groups.iter().enumerate() {
            if g.id == 0 {
                return Err(AluaError(
                    "target port group 0: identifiers start at 1".into(),
                ));
            }
            if groups[..i].iter().any(|h| h.id == g.id) {
                return Err(AluaError(format!(
                    "target port group {} is given twice",
                    g.id
                )));
            }
            if g.ports.is_empty() {
                return Err(AluaError(format!(
                    "target port group {} has no port; list the portal group tags of its gateways in `ports`",
                    g.id
                )));
            }
            if g.ports.len() > MAX_PORTS {
                return Err(AluaError(format!(
                    "target port group {} has {} ports; at most {MAX_PORTS}",
                    g.id,
                    g.ports.len()
                )));
            }
            for &p in &g.ports {
                if p == 0 {
                    return Err(AluaError(format!(
                        "target port group {}: port 0; relative target port identifiers (portal group tags) start at 1",
                        g.id
                    )));
                }
                if let Some(other) = ports.insert(p, g.id) {
                    return Err(AluaError(format!(
                        "port {p} is in target port groups {other} and {}; a port is in one group",
                        g.id
                    )));
                }
            }
        }
        Ok(Alua { groups })
    }

    pub fn groups(&self) -> &[PortGroup] {
        &self.groups
    }

    /// The group that relative target port `port` is in.
    pub fn group_of(&self, port: u16) -> Option<&PortGroup> {
        self.groups.iter().find(|g| g.ports.contains(&port))
    }

    /// The access state seen through `port`: that of its group; a port in no group is served
    /// as active/optimized.
    pub fn state_of(&self, port: u16) -> AccessState {
        self.group_of(port)
            .map_or(AccessState::ActiveOptimized, |g| g.state)
    }

    /// The group with identifier `id`.
    pub fn group(&self, id: u16) -> Option<&PortGroup> {
        self.groups.iter().find(|g| g.id == id)
    }

    /// These groups with the states `stored` gives them (groups it does not name keep theirs;
    /// groups only it names are not these groups, and are left out).
    pub fn with_stored(&self, stored: &Stored) -> Alua {
        let mut next = self.clone();
        for g in &mut next.groups {
            if let Some((state, _)) = stored.states.get(&g.id) {
                g.state = *state;
            }
        }
        next
    }

    /// REPORT TARGET PORT GROUPS parameter data (SPC-4 6.37), in the length-only format or the
    /// extended one (IMPLICIT TRANSITION TIME 0: a change takes effect at once). `changed` are
    /// the groups whose state was changed since the unit began, with who changed it (STATUS
    /// CODE 01h by SET TARGET PORT GROUPS, 02h by the target).
    pub fn report(&self, extended: bool, changed: &[(u16, ChangedBy)]) -> Vec<u8> {
        let mut d = vec![0u8; if extended { 8 } else { 4 }];
        if extended {
            d[4] = 0x10; // FORMAT TYPE 001b
        }
        for g in &self.groups {
            let mut h = [0u8; 8];
            h[0] = (u8::from(g.preferred) << 7) | g.state.code();
            // Supported: active/optimized, active/non-optimized, standby, unavailable.
            h[1] = 0x0F;
            h[2..4].copy_from_slice(&g.id.to_be_bytes());
            h[5] = changed
                .iter()
                .find(|(id, _)| *id == g.id)
                .map_or(0x00, |(_, by)| by.code());
            h[7] = g.ports.len() as u8;
            d.extend_from_slice(&h);
            for p in &g.ports {
                d.extend_from_slice(&[0, 0]);
                d.extend_from_slice(&p.to_be_bytes());
            }
        }
        let len = (d.len() - 4) as u32;
        d[0..4].copy_from_slice(&len.to_be_bytes());
        d
    }

    /// Groups whose state differs between `self` and `next` (or that only one has).
    pub fn changed_groups(&self, next: &Alua) -> Vec<u16> {
        let mut out: Vec<u16> = next
            .groups
            .iter()
            .filter(|g| self.groups.iter().find(|h| h.id == g.id) != Some(g))
            .map(|g| g.id)
            .collect();
        out.extend(
            self.groups
                .iter()
                .filter(|h| !next.groups.iter().any(|g| g.id == h.id))
                .map(|h| h.id),
        );
        out
    }
}

/// One group of REPORT TARGET PORT GROUPS parameter data as an initiator reads it: its
/// identifier, ASYMMETRIC ACCESS STATE code and STATUS CODE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    pub id: u16,
    pub state: u8,
    pub status: u8,
}

/// The groups of REPORT TARGET PORT GROUPS parameter data (either format); a descriptor cut
/// short by the data's end is left out.
pub fn read_report(d: &[u8]) -> Vec<Reported> {
    let start = if d.get(4).is_some_and(|b| b & 0x70 == 0x10) {
        8
    } else {
        4
    };
    let mut out = Vec::new();
    let mut i = start;
    while let Some(h) = d.get(i..i + 8) {
        out.push(Reported {
            id: u16::from_be_bytes([h[2], h[3]]),
            state: h[0] & 0x0F,
            status: h[5],
        });
        i += 8 + 4 * h[7] as usize;
    }
    out
}

/// SET TARGET PORT GROUPS parameter data setting each (group, ASYMMETRIC ACCESS STATE code).
pub fn set_parameters(set: &[(u16, u8)]) -> Vec<u8> {
    let mut p = vec![0u8; 4];
    for &(id, code) in set {
        p.extend_from_slice(&[code, 0]);
        p.extend_from_slice(&id.to_be_bytes());
    }
    p
}

/// Whether a command with operation code `op` (service action `sa`) may run through a port in
/// `state` (SPC-4 5.15.2.4): every command in the active states; in standby, those that
/// identify the unit, its modes and logs, its reservations and its port groups; in the
/// unavailable state, only those that identify the unit and its port groups.
pub fn allowed(state: AccessState, opc: u8, sa: u8) -> bool {
    use crate::lu::op::*;
    let port_groups =
        matches!(opc, MAINTENANCE_IN | MAINTENANCE_OUT) && sa == SA_REPORT_TARGET_PORT_GROUPS;
    let identify = matches!(opc, INQUIRY | REPORT_LUNS | REQUEST_SENSE) || port_groups;
    match state {
        AccessState::ActiveOptimized | AccessState::ActiveNonOptimized => true,
        AccessState::Standby => {
            identify
                || matches!(
                    opc,
                    LOG_SELECT
                        | LOG_SENSE
                        | MODE_SELECT_6
                        | MODE_SELECT_10
                        | MODE_SENSE_6
                        | MODE_SENSE_10
                        | RECEIVE_DIAGNOSTIC_RESULTS
                        | SEND_DIAGNOSTIC
                        | PERSISTENT_RESERVE_IN
                        | PERSISTENT_RESERVE_OUT
                )
                || (opc == MAINTENANCE_IN
                    && matches!(sa, SA_REPORT_SUPPORTED_OPCODES | SA_REPORT_SUPPORTED_TMF))
        }
        AccessState::Unavailable => identify,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(id: u16, state: AccessState, ports: &[u16]) -> PortGroup {
        PortGroup {
            id,
            state,
            preferred: false,
            ports: ports.to_vec(),
        }
    }

    #[test]
    fn groups_are_checked_whole() {
        use AccessState::*;
        let bad = [
            (vec![], "no target port group"),
            (vec![group(0, Standby, &[1])], "start at 1"),
            (
                vec![group(1, Standby, &[1]), group(1, Standby, &[2])],
                "given twice",
            ),
            (vec![group(1, Standby, &[])], "no port"),
            (vec![group(1, Standby, &[0])], "port 0"),
            (
                vec![group(1, Standby, &[1, 2]), group(2, Standby, &[2])],
                "port 2 is in target port groups 1 and 2",
            ),
        ];
        for (groups, why) in bad {
            let e = Alua::new(groups.clone()).unwrap_err();
            assert!(e.0.contains(why), "{groups:?}: {e}");
        }
        let a = Alua::new(vec![
            group(1, ActiveOptimized, &[1]),
            group(2, Standby, &[2, 3]),
        ])
        .unwrap();
        assert_eq!(a.state_of(3), Standby);
        assert_eq!(a.state_of(1), ActiveOptimized);
        assert_eq!(a.state_of(9), ActiveOptimized);
    }

    #[test]
    fn report_has_one_descriptor_per_group() {
        use AccessState::*;
        let a = Alua::new(vec![
            PortGroup {
                preferred: true,
                ..group(1, ActiveOptimized, &[1])
            },
            group(7, ActiveNonOptimized, &[2, 0x0102]),
        ])
        .unwrap();
        let d = a.report(false, &[(7, ChangedBy::Implicit)]);
        assert_eq!(
            u32::from_be_bytes(d[0..4].try_into().unwrap()) as usize,
            d.len() - 4
        );
        assert_eq!(&d[4..12], &[0x80, 0x0F, 0, 1, 0, 0, 0, 1]);
        assert_eq!(&d[12..16], &[0, 0, 0, 1]);
        assert_eq!(&d[16..24], &[0x01, 0x0F, 0, 7, 0, 0x02, 0, 2]);
        let x = a.report(false, &[(1, ChangedBy::Explicit)]);
        assert_eq!(&x[4..12], &[0x80, 0x0F, 0, 1, 0, 0x01, 0, 1]);
        assert_eq!(&d[24..32], &[0, 0, 0, 2, 0, 0, 1, 2]);
        assert_eq!(d.len(), 32);
        let seen: Vec<(u16, u8, u8)> = read_report(&x)
            .iter()
            .map(|r| (r.id, r.state, r.status))
            .collect();
        assert_eq!(seen, vec![(1, 0, 1), (7, 1, 0)]);
        let cut = &d[..20];
        assert_eq!(
            read_report(cut).len(),
            1,
            "a descriptor cut short is left out"
        );
        assert!(read_report(&[]).is_empty());
        let e = a.report(true, &[]);
        assert_eq!(read_report(&e).len(), 2, "extended format");
        assert_eq!(&e[4..8], &[0x10, 0, 0, 0]);
        assert_eq!(e.len(), 36);
        assert_eq!(u32::from_be_bytes(e[0..4].try_into().unwrap()), 32);
    }

    #[test]
    fn standby_and_unavailable_refuse_media_access() {
        use AccessState::*;
        let read10 = 0x28;
        let write10 = 0x2A;
        let tur = 0x00;
        for s in [ActiveOptimized, ActiveNonOptimized] {
            assert!(allowed(s, read10, 0) && allowed(s, write10, 0) && allowed(s, tur, 0));
        }
        for s in [Standby, Unavailable] {
            assert!(!allowed(s, read10, 0) && !allowed(s, write10, 0) && !allowed(s, tur, 0));
            assert!(allowed(s, 0x12, 0) && allowed(s, 0xA0, 0) && allowed(s, 0xA3, 0x0A));
            assert!(!allowed(s, 0xA3, 0x00));
        }
        assert!(allowed(Standby, 0x5F, 0) && !allowed(Unavailable, 0x5F, 0));
        assert!(allowed(Standby, 0x1A, 0) && !allowed(Unavailable, 0x1A, 0));
    }

    #[test]
    fn stored_states_read_back_and_override_the_configured_ones() {
        use AccessState::*;
        let mut st = Stored::default();
        assert_eq!(Stored::parse(b"").unwrap(), st);
        st.states.insert(2, (ActiveOptimized, ChangedBy::Explicit));
        st.states.insert(1, (Unavailable, ChangedBy::Implicit));
        let bytes = st.to_bytes();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            "mcsi port group states 1\n1 unavailable implicit\n2 active/optimized explicit\n"
        );
        assert_eq!(Stored::parse(&bytes).unwrap(), st);
        let a = Alua::new(vec![
            group(1, ActiveOptimized, &[1]),
            group(2, Standby, &[2]),
            group(3, Standby, &[3]),
        ])
        .unwrap();
        let b = a.with_stored(&st);
        assert_eq!(
            (b.state_of(1), b.state_of(2), b.state_of(3)),
            (Unavailable, ActiveOptimized, Standby)
        );
        for bad in [
            &b"1 standby explicit\n"[..],
            b"mcsi port group states 1\n1 sleepy explicit\n",
            b"mcsi port group states 1\n1 standby\n",
            b"mcsi port group states 1\nx standby explicit\n",
            b"\xff",
        ] {
            assert!(Stored::parse(bad).is_err(), "{bad:?}");
        }
        let many: String = std::iter::once("mcsi port group states 1\n".to_string())
            .chain((1..=MAX_GROUPS + 1).map(|i| format!("{i} standby implicit\n")))
            .collect();
        assert!(Stored::parse(many.as_bytes()).is_err());
    }

    #[test]
    fn changed_groups_are_those_that_differ() {
        use AccessState::*;
        let a = Alua::new(vec![
            group(1, ActiveOptimized, &[1]),
            group(2, Standby, &[2]),
        ])
        .unwrap();
        let b = Alua::new(vec![
            group(1, ActiveOptimized, &[1]),
            group(2, ActiveNonOptimized, &[2]),
        ])
        .unwrap();
        assert_eq!(a.changed_groups(&b), vec![2]);
        assert_eq!(a.changed_groups(&a), Vec::<u16>::new());
        let c = Alua::new(vec![group(1, ActiveOptimized, &[1])]).unwrap();
        assert_eq!(a.changed_groups(&c), vec![2]);
    }
}
