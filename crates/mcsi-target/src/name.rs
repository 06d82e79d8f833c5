//! iSCSI names (RFC 3720 section 3.2.6, kept by RFC 7143 section 4.2.7): `iqn.`, `eui.` and
//! `naa.` formats.

/// Why a string is not a valid iSCSI name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("iSCSI name is empty (use iqn.YYYY-MM.reversed.domain[:name], eui.<16 hex> or naa.<16|32 hex>)")]
    Empty,
    #[error("iSCSI name '{0}' is longer than 223 bytes")]
    TooLong(String),
    #[error("iSCSI name '{0}' must start with 'iqn.', 'eui.' or 'naa.'")]
    UnknownFormat(String),
    #[error("iSCSI name '{name}': {why}")]
    Invalid { name: String, why: &'static str },
}

/// Longest iSCSI name in bytes (RFC 3720 3.2.6.1).
pub const MAX_NAME_LEN: usize = 223;

/// Checks the InitiatorName a login gives, more leniently than [`validate`] (initiators in the
/// field send upper case and other characters that stringprep would fold): at most 223 bytes,
/// one of the three formats by its prefix (any case), and no control character, quote or
/// backslash. The name goes into logs, `/state` and metric labels, where those would let an
/// initiator forge lines.
pub fn check_peer(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong(name.chars().take(64).collect()));
    }
    let shown = || name.escape_debug().to_string();
    let prefix = name.get(..4).map(str::to_ascii_lowercase);
    if !matches!(prefix.as_deref(), Some("iqn." | "eui." | "naa.")) {
        return Err(NameError::UnknownFormat(shown()));
    }
    if name
        .chars()
        .any(|c| c.is_control() || c == '"' || c == '\\' || c.is_whitespace())
    {
        return Err(NameError::Invalid {
            name: shown(),
            why: "control characters, white space, quotes and backslashes are not allowed",
        });
    }
    Ok(())
}

/// Checks an iSCSI name. Names are compared case-insensitively on the wire after stringprep; we
/// only accept the already-normalised form (lower case), as RFC 3722 output would be.
pub fn validate(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong(name.to_string()));
    }
    let bad = |why| NameError::Invalid {
        name: name.to_string(),
        why,
    };
    if let Some(rest) = name.strip_prefix("iqn.") {
        // iqn.YYYY-MM.reversed.domain[:anything] (3.2.6.3.1).
        let b = rest.as_bytes();
        if b.len() < 8
            || !b[..4].iter().all(u8::is_ascii_digit)
            || b[4] != b'-'
            || !b[5..7].iter().all(u8::is_ascii_digit)
        {
            return Err(bad("'iqn.' must be followed by a date YYYY-MM"));
        }
        let month = (b[5] - b'0') * 10 + (b[6] - b'0');
        if !(1..=12).contains(&month) {
            return Err(bad("month of the date must be 01..12"));
        }
        if b[7] != b'.' {
            return Err(bad(
                "the date must be followed by '.' and a reversed domain name",
            ));
        }
        let tail = &rest[8..];
        let domain = tail.split(':').next().unwrap_or("");
        if domain.is_empty() || domain.starts_with('.') || domain.ends_with('.') {
            return Err(bad("missing reversed domain name after the date"));
        }
        if !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | ':'))
        {
            return Err(bad(
                "only lower-case letters, digits, '-', '.' and ':' are allowed",
            ));
        }
        Ok(())
    } else if let Some(hex) = name.strip_prefix("eui.") {
        // eui. + 16 hex digits (EUI-64, 3.2.6.3.2).
        if hex.len() != 16 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad("'eui.' must be followed by exactly 16 hex digits"));
        }
        Ok(())
    } else if let Some(hex) = name.strip_prefix("naa.") {
        // naa. + 16 or 32 hex digits (RFC 3980).
        if !(hex.len() == 16 || hex.len() == 32) || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad("'naa.' must be followed by 16 or 32 hex digits"));
        }
        Ok(())
    } else {
        Err(NameError::UnknownFormat(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_name_is_checked_leniently_but_cannot_forge_lines() {
        for ok in [
            "iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-inq",
            "iqn.1991-05.com.microsoft:HOST-01",
            "IQN.1994-05.com.redhat:abc",
            "eui.02004567A425678D",
        ] {
            assert_eq!(check_peer(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "host01",
            "iqn.2026-01.org.x:a\"} 1\nfake_metric 99",
            "iqn.2026-01.org.x:a\\b",
            "iqn.2026-01.org.x:a b",
            "iqn.2026-01.org.x:\u{7}",
        ] {
            assert!(check_peer(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            check_peer(&format!("iqn.2026-01.org.x:{}", "a".repeat(300))),
            Err(NameError::TooLong(_))
        ));
    }

    #[test]
    fn accepts_rfc_examples() {
        // Examples from RFC 3720 3.2.6.3.1 and 3.2.6.3.2.
        for n in [
            "iqn.2001-04.com.example",
            "iqn.2001-04.com.example:storage:diskarrays-sn-a8675309",
            "iqn.2001-04.com.example:storage.tape1.sys1.xyz",
            "iqn.2001-04.com.example:storage.disk2.sys1.xyz",
            "eui.02004567a425678d",
            "naa.52004567ba64678d",
            "naa.62004567ba64678d0123456789abcdef",
        ] {
            assert_eq!(validate(n), Ok(()), "{n}");
        }
    }

    #[test]
    fn rejects_malformed() {
        for n in [
            "",
            "iqn.",
            "iqn.2001-13.com.example",
            "iqn.2001-4.com.example",
            "iqn.2001-04",
            "iqn.2001-04.",
            "iqn.2001-04.Com.Example",
            "iqn.2001-04.com.example:has space",
            "eui.02004567a425678",
            "eui.02004567a425678g",
            "naa.1234",
            "target0",
        ] {
            assert!(validate(n).is_err(), "{n}");
        }
        assert!(validate(&format!("iqn.2001-04.com.example:{}", "a".repeat(210))).is_err());
    }
}
