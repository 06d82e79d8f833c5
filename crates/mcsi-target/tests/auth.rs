#![allow(clippy::unwrap_used, clippy::expect_used)]
//! CHAP and access control over loopback, with mcsi-proto's initiator login (and its CHAP side)
//! driving the target: one-way and mutual CHAP, wrong secrets, unknown users, allow-lists of
//! initiator names and source networks, discovery credentials, and the login status each
//! refusal gets (authentication 2/01, authorization 2/02, not found 2/03).

mod common;

use common::*;
use mcsi_proto::chap::{ChapCredentials, ChapInitiator};
use mcsi_proto::keys::SessionType;
use mcsi_proto::login::{InitiatorLogin, InitiatorLoginConfig, InitiatorStep, LoginError};
use mcsi_proto::pdu::*;
use mcsi_target::config::{AuthSpec, ChapUser, Network};
use mcsi_target::Server;

const HOST: &str = "iqn.2026-01.org.mcsi:host";
const ISID: Isid = Isid([0x80, 0, 0, 0, 0x42, 1]);

fn user(name: &str, secret: &str, mutual: Option<(&str, &str)>) -> ChapUser {
    ChapUser {
        user: name.into(),
        secret: secret.into(),
        mutual_user: mutual.map(|m| m.0.into()),
        mutual_secret: mutual.map(|m| m.1.into()),
    }
}

/// Runs a whole login over a socket; Ok(TSIH) or the initiator's error.
async fn login(server: &Server, mut cfg: InitiatorLoginConfig) -> Result<u16, LoginError> {
    let mut c = Client::connect(server).await;
    cfg.cmd_sn = 1;
    let mut machine = InitiatorLogin::new(cfg);
    let mut req = machine.start();
    loop {
        c.send(Pdu::LoginRequest(req)).await;
        let Pdu::LoginResponse(r) = c.recv().await else {
            panic!("not a Login Response")
        };
        match machine.handle(&r) {
            InitiatorStep::Send(q) => req = q,
            InitiatorStep::FullFeature(o) => return Ok(o.tsih),
            InitiatorStep::Failed(e) => return Err(e),
        }
    }
}

fn chap(creds: ChapCredentials) -> Box<ChapInitiator> {
    let mut n = 0u8;
    Box::new(
        ChapInitiator::new(creds, move |b: &mut [u8]| {
            for x in b {
                n = n.wrapping_add(101);
                *x = n;
            }
        })
        .unwrap(),
    )
}

fn normal(creds: Option<ChapCredentials>) -> InitiatorLoginConfig {
    let mut cfg = InitiatorLoginConfig::normal(HOST, IQN, ISID);
    if let Some(c) = creds {
        cfg.authenticator = chap(c);
    }
    cfg
}

fn status_of(r: Result<u16, LoginError>) -> (u8, u8) {
    match r {
        Err(LoginError::Status { class, detail, .. }) => (class, detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn one_way_chap() {
    let server = start_with(|c| {
        c.targets[0].auth.chap = vec![user("alice", "alice-secret-1", None)];
    })
    .await;
    let tsih = login(
        &server,
        normal(Some(ChapCredentials::new("alice", "alice-secret-1"))),
    )
    .await
    .unwrap();
    assert_ne!(tsih, 0);
    // Wrong secret, unknown user, no CHAP at all: authentication failure 2/01.
    let wrong = normal(Some(ChapCredentials::new("alice", "not-the-secret")));
    assert_eq!(status_of(login(&server, wrong).await), (2, 1));
    let unknown = normal(Some(ChapCredentials::new("mallory", "alice-secret-1")));
    assert_eq!(status_of(login(&server, unknown).await), (2, 1));
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 1));
    // An unknown target: 2/03, whatever the credentials.
    let mut cfg = normal(Some(ChapCredentials::new("alice", "alice-secret-1")));
    cfg.target_name = Some("iqn.2026-01.org.mcsi:nope".into());
    assert_eq!(status_of(login(&server, cfg).await), (2, 3));
}

#[tokio::test]
async fn mutual_chap() {
    let server = start_with(|c| {
        c.targets[0].auth.chap = vec![user(
            "alice",
            "alice-secret-1",
            Some(("disk", "target-secret-2")),
        )];
    })
    .await;
    let creds =
        ChapCredentials::new("alice", "alice-secret-1").with_mutual("disk", "target-secret-2");
    login(&server, normal(Some(creds))).await.unwrap();
    // The initiator expects another target secret: the target's answer does not check out,
    // and the initiator gives up (its own decision, not a status from the target).
    let creds =
        ChapCredentials::new("alice", "alice-secret-1").with_mutual("disk", "other-secret-3");
    match login(&server, normal(Some(creds))).await {
        Err(LoginError::Auth(_)) => {}
        other => panic!("expected the initiator to refuse the target, got {other:?}"),
    }
}

#[tokio::test]
async fn allow_lists_refuse_with_authorization_failure() {
    let server = start_with(|c| {
        c.targets[0].auth = AuthSpec {
            chap: Vec::new(),
            allow_initiators: vec!["iqn.2026-01.org.mcsi:other".into()],
            ..AuthSpec::default()
        };
    })
    .await;
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 2));
    let mut cfg = normal(None);
    cfg.initiator_name = "iqn.2026-01.org.mcsi:other".into();
    login(&server, cfg).await.unwrap();

    // Source networks: loopback is not in 10.0.0.0/8.
    let server = start_with(|c| {
        c.targets[0].auth.allow_networks = vec![Network::parse("10.0.0.0/8").unwrap()];
    })
    .await;
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 2));
    let server = start_with(|c| {
        c.targets[0].auth.allow_networks = vec![Network::parse("127.0.0.0/8").unwrap()];
    })
    .await;
    login(&server, normal(None)).await.unwrap();
}

#[tokio::test]
async fn discovery_credentials() {
    let server = start_with(|c| {
        c.discovery_auth.chap = vec![user("seeker", "discovery-secret", None)];
    })
    .await;
    let disc = |creds: Option<ChapCredentials>| {
        let mut cfg = InitiatorLoginConfig::discovery(HOST, ISID);
        assert_eq!(cfg.session_type, SessionType::Discovery);
        if let Some(c) = creds {
            cfg.authenticator = chap(c);
        }
        cfg
    };
    assert_eq!(status_of(login(&server, disc(None)).await), (2, 1));
    login(
        &server,
        disc(Some(ChapCredentials::new("seeker", "discovery-secret"))),
    )
    .await
    .unwrap();
    // The target itself stays open: its auth table is empty.
    login(&server, normal(None)).await.unwrap();
}

/// MD5 is not allowed unless the target names it; an initiator that offers only MD5 (as
/// libiscsi does) is refused with 2/01 by default.
#[tokio::test]
async fn md5_only_when_the_target_allows_it() {
    use mcsi_proto::chap::ChapAlgorithm;
    let md5_only = || {
        let mut cfg = normal(None);
        cfg.authenticator = Box::new(
            ChapInitiator::new(
                ChapCredentials::new("alice", "alice-secret-1"),
                |b: &mut [u8]| b.fill(7),
            )
            .unwrap()
            .with_algorithms(&[ChapAlgorithm::Md5]),
        );
        cfg
    };
    let server = start_with(|c| {
        c.targets[0].auth.chap = vec![user("alice", "alice-secret-1", None)];
    })
    .await;
    assert_eq!(status_of(login(&server, md5_only()).await), (2, 1));
    let server = start_with(|c| {
        c.targets[0].auth.chap = vec![user("alice", "alice-secret-1", None)];
        c.targets[0].auth.chap_algorithms = vec![ChapAlgorithm::Sha256, ChapAlgorithm::Md5];
    })
    .await;
    assert_ne!(login(&server, md5_only()).await.unwrap(), 0);
}

/// A second wrong secret in a row locks its user out for a second (then 2, 4, ... up to 60):
/// the right secret right after is refused too, and accepted once the lock has passed.
#[tokio::test]
async fn failed_logins_lock_their_user_out_for_a_while() {
    let server = start_with(|c| {
        c.targets[0].auth.chap = vec![
            user("alice", "alice-secret-1", None),
            user("bob", "bob-secret-123", None),
        ];
    })
    .await;
    let right = || normal(Some(ChapCredentials::new("alice", "alice-secret-1")));
    let wrong = || normal(Some(ChapCredentials::new("alice", "not-the-secret")));
    assert_eq!(status_of(login(&server, wrong()).await), (2, 1));
    assert_eq!(status_of(login(&server, wrong()).await), (2, 1));
    assert_eq!(status_of(login(&server, right()).await), (2, 1), "locked");
    // Another user is not held.
    let bob = normal(Some(ChapCredentials::new("bob", "bob-secret-123")));
    assert_ne!(login(&server, bob).await.unwrap(), 0);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert_ne!(login(&server, right()).await.unwrap(), 0);
}

/// Access changed while the target runs (`mcsi ctl`): each login sees the access of the moment,
/// sessions already logged in stay, and a refused change leaves the access as it was.
#[tokio::test]
async fn access_changes_while_running_apply_to_the_next_login() {
    use mcsi_target::admin::AdminError;
    let server = start(|_| {}).await;
    let admin = server.admin();
    // A session logged in before any change, by an initiator the changes will leave out.
    let kept = Client::normal_isid(&server, [0x80, 9, 9, 9, 9, 9], &[]).await;

    // Allow-list: the first name closes the target to every other initiator.
    admin
        .allow_initiator(None, "iqn.2026-01.org.mcsi:other")
        .await
        .unwrap();
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 2));
    admin.allow_initiator(None, HOST).await.unwrap();
    assert!(login(&server, normal(None)).await.is_ok());
    assert!(matches!(
        admin.allow_initiator(None, HOST).await,
        Err(AdminError::AlreadyAllowed { .. })
    ));
    assert!(matches!(
        admin.allow_initiator(None, "not a name").await,
        Err(AdminError::BadSpec(_))
    ));
    assert!(matches!(
        admin
            .disallow_initiator(None, "iqn.2026-01.org.mcsi:never", false)
            .await,
        Err(AdminError::NotAllowed { .. })
    ));
    admin.disallow_initiator(None, HOST, false).await.unwrap();
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 2));
    // The last name goes only when asked to open the target.
    let last = admin
        .disallow_initiator(None, "iqn.2026-01.org.mcsi:other", false)
        .await
        .unwrap_err();
    assert!(matches!(last, AdminError::WouldOpen(_)), "{last}");
    assert_eq!(
        status_of(login(&server, normal(None)).await),
        (2, 2),
        "still closed"
    );
    admin
        .disallow_initiator(None, "iqn.2026-01.org.mcsi:other", true)
        .await
        .unwrap();
    assert!(
        login(&server, normal(None)).await.is_ok(),
        "an empty list admits any"
    );

    // CHAP: a secret too short is refused and changes nothing.
    let short = admin
        .add_chap_user(None, user("bob", "short", None))
        .await
        .unwrap_err();
    assert!(short.to_string().contains("too short"), "{short}");
    assert!(login(&server, normal(None)).await.is_ok(), "still no CHAP");
    admin
        .add_chap_user(None, user("bob", "bob-secret-123", None))
        .await
        .unwrap();
    assert_eq!(status_of(login(&server, normal(None)).await), (2, 1));
    assert!(login(
        &server,
        normal(Some(ChapCredentials::new("bob", "bob-secret-123")))
    )
    .await
    .is_ok());
    assert!(matches!(
        admin
            .add_chap_user(None, user("bob", "another-secret-9", None))
            .await,
        Err(AdminError::ChapUserExists { .. })
    ));
    let listed = admin.targets();
    assert_eq!(listed[0].chap_users, vec!["bob".to_string()]);
    assert!(matches!(
        admin.remove_chap_user(None, "eve", false).await,
        Err(AdminError::NoChapUser { .. })
    ));
    assert!(matches!(
        admin.remove_chap_user(None, "bob", false).await,
        Err(AdminError::WouldOpen(_))
    ));
    assert_eq!(
        status_of(login(&server, normal(None)).await),
        (2, 1),
        "CHAP still needed"
    );
    admin.remove_chap_user(None, "bob", true).await.unwrap();
    assert!(login(&server, normal(None)).await.is_ok());
    // The first session was never touched by any of it.
    assert!(admin.sessions().iter().any(|s| s.tsih == kept.tsih));
}
