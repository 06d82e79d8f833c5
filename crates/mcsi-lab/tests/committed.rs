#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The committed lab results in docs/lab say what their data says: each report, rewritten from
//! its runs.csv, is the committed report word for word (so every number in a discussion is the
//! median it names), and each was made from the spec that ships.

use std::path::{Path, PathBuf};

fn docs_lab() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/lab")
}

#[test]
fn committed_reports_match_their_data_and_the_shipped_specs() {
    let mut seen = 0;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(docs_lab())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("runs.csv").exists())
        .collect();
    entries.sort();
    for dir in entries {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let spec = std::fs::read_to_string(dir.join("spec.toml")).unwrap();
        let shipped = mcsi_lab::BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("docs/lab/{name}: no shipped spec of that name"))
            .1;
        assert_eq!(
            spec, shipped,
            "docs/lab/{name}/spec.toml differs from crates/mcsi-lab/experiments/{name}.toml: copy it there and run `mcsi lab report docs/lab` (or rerun the experiment if its points changed)"
        );
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join(&name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["meta.json", "runs.csv", "spec.toml"] {
            std::fs::copy(dir.join(f), d.join(f)).unwrap();
        }
        let exp = mcsi_lab::spec::parse(&name, "spec.toml", &spec).unwrap();
        mcsi_lab::report::write(&exp, &d).unwrap();
        for f in ["report.md", "results.csv"] {
            let want = std::fs::read_to_string(d.join(f)).unwrap();
            let have = std::fs::read_to_string(dir.join(f)).unwrap();
            if want != have {
                let line = want
                    .lines()
                    .zip(have.lines())
                    .find(|(a, b)| a != b)
                    .map_or("(lengths differ)".to_string(), |(a, b)| {
                        format!("\n  from the data: {a}\n  committed:     {b}")
                    });
                panic!("docs/lab/{name}/{f} is not what its runs.csv gives; run `mcsi lab report docs/lab`. First difference:{line}");
            }
        }
        seen += 1;
    }
    // Every shipped experiment has its committed runs.
    let missing: Vec<&str> = mcsi_lab::BUILTIN
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !docs_lab().join(n).join("runs.csv").exists())
        .collect();
    assert!(
        missing.is_empty(),
        "shipped experiments without committed runs in docs/lab: {missing:?} (run `mcsi lab run NAME --out docs/lab`)"
    );
    assert_eq!(seen, mcsi_lab::BUILTIN.len(), "committed experiments");
}
