//! The `tandem` CLI as a user runs it, checked against transformers references:
//! `tandem eval logits` and `tandem generate` on the public tiny KDA-hybrid checkpoints, and
//! `tandem model synth` output loading back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use tandem_e2e::tandem_bin;

fn run_json(args: &[&str]) -> Value {
    let out = Command::new(tandem_bin())
        .args(args)
        .output()
        .expect("run tandem");
    assert!(
        out.status.success(),
        "tandem {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn ids_arg(v: &Value) -> String {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn check_reference(name: &str) {
    let dir = tandem_testkit::shared_dir().join("reference").join(name);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let model = dir.display().to_string();
    for seq in reference["sequences"].as_array().unwrap() {
        let ids = ids_arg(&seq["input_ids"]);
        let got = run_json(&[
            "eval",
            "logits",
            "--model",
            &model,
            "--token-ids",
            &ids,
            "--json",
        ]);
        let (got, want) = (
            got["logits"].as_array().unwrap(),
            seq["logits"].as_array().unwrap(),
        );
        assert_eq!(got.len(), want.len());
        let mut max = 0.0f64;
        for (g, w) in got.iter().zip(want) {
            for (a, b) in g.as_array().unwrap().iter().zip(w.as_array().unwrap()) {
                max = max.max((a.as_f64().unwrap() - b.as_f64().unwrap()).abs());
            }
        }
        assert!(
            max <= 1e-3,
            "{name} {}: max |logit diff| {max}",
            seq["name"]
        );
        let greedy = &seq["greedy"];
        let n = greedy["num_new_tokens"].as_u64().unwrap().to_string();
        let gen = run_json(&[
            "generate",
            "--model",
            &model,
            "--token-ids",
            &ids,
            "--max-tokens",
            &n,
            "--json",
        ]);
        let want_ids: Vec<u64> = greedy["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let got_ids: Vec<u64> = gen["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        // Generation stops at EOS; the reference runs a fixed count.
        assert!(
            !got_ids.is_empty() && want_ids.starts_with(&got_ids),
            "{name} {}: {got_ids:?} vs {want_ids:?}",
            seq["name"]
        );
    }
}

#[test]
fn eval_logits_and_generate_match_kimi_tiny_reference() {
    check_reference("kimi_tiny");
}

#[test]
fn eval_logits_and_generate_match_glm5_tiny_reference() {
    check_reference("glm5_tiny");
}

#[test]
fn bad_layouts_and_inputs_fail_clearly() {
    let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let model = dir.display().to_string();
    let fail = |args: &[&str]| -> String {
        let out = Command::new(tandem_bin()).args(args).output().unwrap();
        assert!(!out.status.success(), "tandem {args:?} should fail");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = fail(&[
        "eval",
        "logits",
        "--model",
        &model,
        "--token-ids",
        "1,2,3",
        "--tp",
        "4",
        "--dp",
        "3",
    ]);
    assert!(err.contains("divisible"), "{err}");
    let err = fail(&[
        "eval",
        "logits",
        "--model",
        &model,
        "--token-ids",
        "1,99999",
    ]);
    assert!(err.contains("99999"), "{err}");
}

#[test]
fn synthesised_checkpoints_load_and_run() {
    let tmp = tempfile::tempdir().unwrap();
    for (sub, fp8) in [("bf16", false), ("fp8", true)] {
        let out = tmp.path().join(sub);
        let mut args = vec![
            "model",
            "synth",
            "--arch",
            "kda-hybrid",
            "--preset",
            "tiny",
            "--out",
            out.to_str().unwrap(),
        ];
        if fp8 {
            args.push("--fp8");
        }
        let status = Command::new(tandem_bin()).args(&args).status().unwrap();
        assert!(status.success());
        assert!(Path::new(&out).join("model.safetensors").exists());
    }
    let bf16 = run_json(&[
        "generate",
        "--model",
        tmp.path().join("bf16").to_str().unwrap(),
        "--token-ids",
        "5,17,42",
        "--max-tokens",
        "4",
        "--json",
    ]);
    assert_eq!(bf16["token_ids"].as_array().unwrap().len(), 4);
}

#[test]
fn layouts_give_the_reference_logits_and_tokens() {
    let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let model = dir.display().to_string();
    let seq = &reference["sequences"][1]; // 67 tokens: two KDA chunks
    let ids = ids_arg(&seq["input_ids"]);
    let want = seq["logits"].as_array().unwrap();
    for layout in [
        ["2", "1", "1"],
        ["4", "2", "1"],
        ["4", "1", "4"],
        ["4", "4", "2"],
    ] {
        let got = run_json(&[
            "eval",
            "logits",
            "--model",
            &model,
            "--token-ids",
            &ids,
            "--json",
            "--tp",
            layout[0],
            "--dp",
            layout[1],
            "--ep",
            layout[2],
        ]);
        let got = got["logits"].as_array().unwrap();
        assert_eq!(got.len(), want.len());
        let max = got
            .iter()
            .zip(want)
            .flat_map(|(g, w)| {
                g.as_array()
                    .unwrap()
                    .iter()
                    .zip(w.as_array().unwrap())
                    .map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs())
                    .collect::<Vec<_>>()
            })
            .fold(0.0f64, f64::max);
        assert!(max <= 1e-3, "layout {layout:?}: max |logit diff| {max}");
    }
    let n = seq["greedy"]["num_new_tokens"]
        .as_u64()
        .unwrap()
        .to_string();
    let gen = run_json(&[
        "generate",
        "--model",
        &model,
        "--token-ids",
        &ids,
        "--max-tokens",
        &n,
        "--json",
        "--tp",
        "4",
        "--dp",
        "2",
    ]);
    let want_ids: Vec<u64> = seq["greedy"]["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let got_ids: Vec<u64> = gen["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        !got_ids.is_empty() && want_ids.starts_with(&got_ids),
        "{got_ids:?} vs {want_ids:?}"
    );
    // kimi_tiny has 4 KDA heads: attention TP 8 cannot split them.
    let out = Command::new(tandem_bin())
        .args([
            "eval",
            "logits",
            "--model",
            &model,
            "--token-ids",
            "1,2",
            "--tp",
            "8",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not divisible") && err.contains('8'), "{err}");
}
