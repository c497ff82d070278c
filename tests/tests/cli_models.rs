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

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
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
        let want_ids = u64s(&greedy["generated_ids"]);
        let got_ids = u64s(&gen["token_ids"]);
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
    let want_ids = u64s(&seq["greedy"]["generated_ids"]);
    let got_ids = u64s(&gen["token_ids"]);
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

/// Writes a safetensors file of F32 tensors.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}));
    }
    let h = Value::Object(header).to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

#[test]
fn lora_adapter_is_applied_at_start_up() {
    let model = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let tmp = tempfile::tempdir().unwrap();
    let lora = tmp.path().join("lora");
    std::fs::create_dir_all(&lora).unwrap();
    std::fs::write(lora.join("adapter_config.json"), r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["f_b_proj", "o_proj"]}"#).unwrap();
    let mut tensors = Vec::new();
    for layer in [0usize, 2, 3] {
        let m = format!("base_model.model.model.layers.{layer}.self_attn");
        let a: Vec<f32> = (0..2 * 64)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.05)
            .collect();
        let b: Vec<f32> = (0..256 * 2)
            .map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05)
            .collect();
        tensors.push((format!("{m}.f_b_proj.lora_A.weight"), vec![2, 64], a));
        tensors.push((format!("{m}.f_b_proj.lora_B.weight"), vec![256, 2], b));
        let a: Vec<f32> = (0..2 * 256)
            .map(|i| ((i * 29 % 13) as f32 - 6.0) * 0.05)
            .collect();
        let b: Vec<f32> = (0..256 * 2)
            .map(|i| ((i * 17 % 5) as f32 - 2.0) * 0.05)
            .collect();
        tensors.push((format!("{m}.o_proj.lora_A.weight"), vec![2, 256], a));
        tensors.push((format!("{m}.o_proj.lora_B.weight"), vec![256, 2], b));
    }
    write_safetensors(&lora.join("adapter_model.safetensors"), &tensors);
    let m = model.display().to_string();
    let ids = "236,5,25,331,240";
    let base = run_json(&[
        "eval",
        "logits",
        "--model",
        &m,
        "--token-ids",
        ids,
        "--json",
    ]);
    let lora_s = lora.to_str().unwrap();
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            &m,
            "--token-ids",
            ids,
            "--max-tokens",
            "6",
            "--json",
        ];
        args.extend_from_slice(extra);
        run_json(&args)
    };
    let gen_base = generate(&[]);
    let gen_lora = generate(&["--lora", lora_s]);
    let gen_lora_tp2 = generate(&["--lora", lora_s, "--tp", "2"]);
    assert!(base["logits"].is_array());
    assert_ne!(
        gen_base["token_ids"], gen_lora["token_ids"],
        "the adapter must change the answer"
    );
    assert_eq!(
        gen_lora["token_ids"], gen_lora_tp2["token_ids"],
        "LoRA under tp2 equals tp1"
    );
    let out = Command::new(tandem_bin())
        .args([
            "generate",
            "--model",
            &m,
            "--token-ids",
            ids,
            "--lora",
            tmp.path().join("nope").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nope"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
