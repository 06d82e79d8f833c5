//! libiscsi's URL form: `iscsi://[user[%password]@]host[:port]/target-iqn/lun`.

use crate::error::Error;
use std::fmt;

/// The IANA-registered iSCSI port.
pub const DEFAULT_PORT: u16 = 3260;

/// A parsed `iscsi://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IscsiUrl {
    pub user: Option<String>,
    pub password: Option<String>,
    /// Host name or address (IPv6 without the brackets).
    pub host: String,
    pub port: u16,
    pub target: String,
    pub lun: u64,
}

impl IscsiUrl {
    /// Whether a command-line argument looks like an iSCSI URL rather than a path.
    pub fn is_url(s: &str) -> bool {
        s.starts_with("iscsi://")
    }

    pub fn parse(s: &str) -> Result<IscsiUrl, Error> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "invalid iSCSI URL {s:?}: {why}; expected iscsi://[user[%password]@]host[:port]/target-iqn/lun"
            ))
        };
        let rest = s
            .strip_prefix("iscsi://")
            .ok_or_else(|| bad("it must start with iscsi://"))?;
        let (authority, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("the target name is missing"))?;
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once('%') {
                Some((user, pass)) => (Some(user.to_string()), Some(pass.to_string())),
                None => (Some(u.to_string()), None),
            },
        };
        if user.as_deref() == Some("") {
            return Err(bad("the user name is empty"));
        }
        let (host, port) = host_port(hostport).map_err(|e| bad(&e.to_string()))?;
        let port = port.unwrap_or(DEFAULT_PORT);
        let path = path.trim_end_matches('/');
        let (target, lun) = path
            .rsplit_once('/')
            .ok_or_else(|| bad("the LUN is missing (add /0 for LUN 0)"))?;
        if target.is_empty() {
            return Err(bad("the target name is empty"));
        }
        if target.contains('/') {
            return Err(bad("the target name may not contain '/'"));
        }
        let lun = lun
            .parse::<u64>()
            .ok()
            .filter(|&l| l <= u64::from(u16::MAX))
            .ok_or_else(|| bad("the LUN must be a number from 0 to 65535"))?;
        Ok(IscsiUrl {
            user,
            password,
            host,
            port,
            target: target.to_string(),
            lun,
        })
    }

    /// The CHAP secret of the URL's user: the URL's password, else the environment's
    /// `MCSI_CHAP_SECRET`, else the first line of the file `MCSI_CHAP_SECRET_FILE` names (so
    /// that the secret need not be on a command line, where `ps` shows it). Empty when none is
    /// given (the target then refuses the login).
    pub fn chap_secret(&self) -> Result<String, Error> {
        chap_secret_from(
            self.password.as_deref(),
            std::env::var(SECRET_ENV).ok(),
            std::env::var_os(SECRET_FILE_ENV).map(std::path::PathBuf::from),
        )
    }

    /// `host:port` for connecting (IPv6 in brackets).
    pub fn address(&self) -> String {
        join(&self.host, self.port)
    }
}

/// The variable that holds the initiator's CHAP secret when the URL has none.
pub const SECRET_ENV: &str = "MCSI_CHAP_SECRET";
/// The variable that names a file holding it (its first line).
pub const SECRET_FILE_ENV: &str = "MCSI_CHAP_SECRET_FILE";

fn chap_secret_from(
    password: Option<&str>,
    env: Option<String>,
    file: Option<std::path::PathBuf>,
) -> Result<String, Error> {
    if let Some(p) = password {
        return Ok(p.to_string());
    }
    if let Some(s) = env {
        return Ok(s);
    }
    if let Some(f) = file {
        let text = std::fs::read_to_string(&f).map_err(|e| {
            Error::InvalidArgument(format!("{SECRET_FILE_ENV}={}: {e}", f.display()))
        })?;
        return Ok(text.lines().next().unwrap_or("").to_string());
    }
    Ok(String::new())
}

/// `host:port`, an IPv6 address in brackets.
fn join(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Why a `HOST:PORT` is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortalError {
    #[error("unterminated [ in the IPv6 address")]
    Unterminated,
    #[error("garbage after the IPv6 address")]
    AfterAddress,
    #[error("expected HOST:PORT (an IPv6 address in brackets: [2001:db8::1]:3260)")]
    Unbracketed,
    #[error("the host is empty")]
    EmptyHost,
    #[error("'{0}' is not a port (1 to 65535)")]
    Port(String),
    #[error("expected HOST:PORT, e.g. 192.0.2.10:3260")]
    NoPort,
}

/// Splits `host[:port]` (an IPv6 address in brackets) and checks the port.
fn host_port(s: &str) -> Result<(String, Option<u16>), PortalError> {
    let (host, port) = if let Some(v6) = s.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or(PortalError::Unterminated)?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(PortalError::AfterAddress),
        };
        (h, port)
    } else if s.matches(':').count() > 1 {
        return Err(PortalError::Unbracketed);
    } else {
        match s.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() {
        return Err(PortalError::EmptyHost);
    }
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| PortalError::Port(p.to_string()))
        })
        .transpose()?;
    Ok((host.to_string(), port))
}

/// A target portal given as `HOST:PORT` (an IPv6 address in brackets), checked and in the form
/// a connection takes.
pub fn portal(s: &str) -> Result<String, PortalError> {
    match host_port(s.trim())? {
        (host, Some(port)) => Ok(join(&host, port)),
        (_, None) => Err(PortalError::NoPort),
    }
}

impl std::str::FromStr for IscsiUrl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        IscsiUrl::parse(s)
    }
}

/// Displays without the password.
impl fmt::Display for IscsiUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "iscsi://")?;
        if let Some(u) = &self.user {
            write!(f, "{u}@")?;
        }
        write!(f, "{}/{}/{}", self.address(), self.target, self.lun)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_form() {
        let u = IscsiUrl::parse("iscsi://alice%s3cret@10.0.0.1:3261/iqn.2001-04.com.example:t1/2")
            .unwrap();
        assert_eq!(u.user.as_deref(), Some("alice"));
        assert_eq!(u.password.as_deref(), Some("s3cret"));
        assert_eq!(u.host, "10.0.0.1");
        assert_eq!(u.port, 3261);
        assert_eq!(u.target, "iqn.2001-04.com.example:t1");
        assert_eq!(u.lun, 2);
        assert_eq!(
            u.to_string(),
            "iscsi://alice@10.0.0.1:3261/iqn.2001-04.com.example:t1/2"
        );
    }

    #[test]
    fn defaults_and_ipv6() {
        let u = IscsiUrl::parse("iscsi://host/iqn.x:y/0").unwrap();
        assert_eq!(u.port, 3260);
        assert_eq!(u.user, None);
        let u = IscsiUrl::parse("iscsi://[::1]:3290/iqn.x:y/1").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.address(), "[::1]:3290");
        assert_eq!(u.lun, 1);
    }

    #[test]
    fn portals() {
        assert_eq!(portal("10.0.0.1:3261").unwrap(), "10.0.0.1:3261");
        assert_eq!(portal("[::1]:3290").unwrap(), "[::1]:3290");
        assert_eq!(portal("10.0.0.1"), Err(PortalError::NoPort));
        assert_eq!(portal("h:0"), Err(PortalError::Port("0".into())));
        assert_eq!(portal("::1:3260"), Err(PortalError::Unbracketed));
        assert_eq!(portal("[::1"), Err(PortalError::Unterminated));
        assert_eq!(portal("[::1]x"), Err(PortalError::AfterAddress));
        assert_eq!(portal(":3260"), Err(PortalError::EmptyHost));
        assert!(PortalError::Unbracketed.to_string().contains("in brackets"));
    }

    #[test]
    fn errors_say_what_is_wrong() {
        for (s, needle) in [
            ("http://h/iqn/0", "must start with iscsi://"),
            ("iscsi://h", "target name is missing"),
            ("iscsi://h/iqn.x:y", "LUN is missing"),
            ("iscsi://h:0/iqn.x:y/0", "port"),
            ("iscsi://h:99999/iqn.x:y/0", "port"),
            ("iscsi://h/iqn.x:y/abc", "LUN must be a number"),
            ("iscsi:///iqn.x:y/0", "host is empty"),
        ] {
            let e = IscsiUrl::parse(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    #[test]
    fn the_chap_secret_comes_from_the_url_then_the_environment_then_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("secret");
        std::fs::write(&f, "from-the-file-123\nignored\n").unwrap();
        assert_eq!(
            chap_secret_from(Some("url"), Some("env".into()), Some(f.clone())).unwrap(),
            "url"
        );
        assert_eq!(
            chap_secret_from(None, Some("env".into()), Some(f.clone())).unwrap(),
            "env"
        );
        assert_eq!(
            chap_secret_from(None, None, Some(f)).unwrap(),
            "from-the-file-123"
        );
        assert_eq!(chap_secret_from(None, None, None).unwrap(), "");
        let e = chap_secret_from(None, None, Some(dir.path().join("missing"))).unwrap_err();
        assert!(e.to_string().contains("MCSI_CHAP_SECRET_FILE="), "{e}");
    }
}
