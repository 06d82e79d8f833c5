//! The target-side CHAP authenticator fed arbitrary key sets. Never panics, never succeeds
//! without the right response, and once it has failed or finished it accepts nothing more.
#![no_main]

mod common;

use common::{pairs, Challenge, Input, SECRET, TARGET_SECRET, TARGET_USER, USER};
use libfuzzer_sys::fuzz_target;
use mcsi_proto::chap::{
    decode_binary, ChapAlgorithm, ChapCredentials, ChapTarget, ChapUsers, Encoding,
};
use mcsi_proto::login::{status, AuthProgress, Authenticator};

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let cfg = inp.u8();
    let mut users = ChapUsers::new();
    let _ =
        users.insert(ChapCredentials::new(USER, SECRET).with_mutual(TARGET_USER, TARGET_SECRET));
    let _ = users.insert(ChapCredentials::new("bob", "bob-secret-000"));
    let allowed: Vec<ChapAlgorithm> = ChapAlgorithm::ALL
        .into_iter()
        .enumerate()
        .filter(|(i, _)| cfg & (1 << i) != 0)
        .map(|(_, a)| a)
        .collect();
    let seed = inp.u8();
    let mut n = seed;
    let mut t = ChapTarget::new(users, move |b: &mut [u8]| {
        for x in b {
            n = n.wrapping_mul(5).wrapping_add(1);
            *x = n;
        }
    })
    .with_algorithms(&allowed)
    .with_encoding(if cfg & 16 != 0 {
        Encoding::Base64
    } else {
        Encoding::Hex
    })
    .with_challenge_len(usize::from(inp.u8()) * 4);
    let method = if cfg & 32 != 0 { "CHAP" } else { "None" };

    let mut challenge = Challenge::default();
    let mut over = false;
    for _ in 0..6 {
        if inp.is_empty() {
            break;
        }
        let keys = pairs(&mut inp, 8, &challenge);
        let r = t.step(method, &keys);
        if over {
            assert!(r.is_err(), "accepted keys after the exchange ended");
            continue;
        }
        match r {
            Err(s) => {
                assert_eq!(s, status::AUTH_FAILED);
                over = true;
            }
            Ok(AuthProgress::Continue(k)) => {
                assert!(challenge.challenge.is_none(), "a second challenge");
                challenge.learn(&k);
                let a = challenge.algorithm.expect("challenge without CHAP_A");
                assert!(allowed.contains(&a));
                let (c, _) = challenge.challenge.as_ref().expect("no CHAP_C");
                assert!(c.len() >= a.digest_len().max(16));
            }
            Ok(AuthProgress::Done(k)) => {
                // Success needs the right response from a known user.
                let get = |key: &str| keys.iter().find(|(a, _)| a == key).map(|(_, v)| v.as_str());
                let name = get("CHAP_N").expect("done without CHAP_N");
                let (got, _) = decode_binary("CHAP_R", get("CHAP_R").expect("no CHAP_R"))
                    .expect("done with a malformed CHAP_R");
                let secret = match name {
                    USER => SECRET,
                    "bob" => "bob-secret-000",
                    other => panic!("unknown user {other:?} authenticated"),
                };
                let want = challenge.answer(secret).expect("done before a challenge");
                assert_eq!(decode_binary("want", &want).map(|x| x.0).ok(), Some(got));
                if get("CHAP_C").is_some() {
                    assert_eq!(
                        name, USER,
                        "mutual answered for a user without target credentials"
                    );
                    assert!(k.iter().any(|(a, v)| a == "CHAP_N" && v == TARGET_USER));
                } else {
                    assert!(k.is_empty());
                }
                over = true;
            }
        }
    }
});
