//! P/D serving of a KDA-hybrid model: a synthesised tiny Kimi-layout checkpoint behind the
//! real router, prefill and decode processes. The prefill worker's per-request state (KDA
//! recurrent state + conv windows, MLA latents) crosses to the decode worker (through its
//! shared-memory landing slot on one host, over UCX otherwise); the
//! answer must equal a single-process greedy run, and every state slot must come back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::process::Command;

use tandem_e2e::{tandem_bin, Cluster, ClusterOptions};

fn synth_model_with_tokenizer(dir: &std::path::Path) {
    // The public tiny Kimi-Linear checkpoint (its random weights give the KDA state a visible
    // effect on the output, unlike a synthetic preset's).
    let reference = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(reference.join(f), dir.join(f)).unwrap();
    }
    // The router needs a tokenizer to detokenize. A word-level one with one word per id
    // ("t0".."t511") makes the returned text spell out the token ids exactly.
    let vocab: serde_json::Map<String, Value> =
        (0..512).map(|i| (format!("t{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}", "eos_token": "t2", "bos_token": "t1", "add_bos_token": false, "model_max_length": 4096});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

fn single_process(dir: &std::path::Path, prompt: &[u32], n: u32) -> Vec<u64> {
    let ids = prompt
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(tandem_bin())
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--token-ids",
            &ids,
            "--max-tokens",
            &n.to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[test]
fn kda_hybrid_pd_equals_single_process_and_frees_every_slot() {
    run_case(Vec::new(), Vec::new());
}

/// Prefill with attention TP 2, decode with DP attention (tp 2 × dp 2, so A = 1): the KDA
/// state is resharded by heads (and per q/k/v conv block) on the way, and requests spread over
/// both decode DP groups.
#[test]
fn kda_hybrid_pd_across_layouts_tp2_to_tp2_dp2() {
    run_case(
        strings(&["--tp", "2"]),
        strings(&["--tp", "2", "--dp", "2"]),
    );
}

/// The second pair: prefill attention TP 4, decode tp 4 × dp 4.
#[test]
fn kda_hybrid_pd_across_layouts_tp4_to_tp4_dp4() {
    run_case(
        strings(&["--tp", "4"]),
        strings(&["--tp", "4", "--dp", "4"]),
    );
}

fn run_case(mut prefill_args: Vec<String>, mut decode_args: Vec<String>) {
    for args in [&mut prefill_args, &mut decode_args] {
        args.extend(strings(&["--state-slots", "8"]));
    }
    let flag = |name: &str| {
        decode_args
            .iter()
            .position(|a| a == name)
            .map_or("1".to_string(), |i| decode_args[i + 1].clone())
    };
    let expected_decode_layout = format!("tp{} dp{} ep1", flag("--tp"), flag("--dp"));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kda-tiny");
    synth_model_with_tokenizer(&dir);
    let prompts: Vec<Vec<u32>> = vec![
        vec![11, 40, 7, 200, 33],
        vec![500, 3, 77],
        (0..20).map(|i| 100 + i * 13).collect(),
        (0..70).map(|i| 3 + (i * 37) % 280).collect(),
    ];
    let expected: Vec<Vec<u64>> = prompts.iter().map(|p| single_process(&dir, p, 8)).collect();
    let cluster = Cluster::start(ClusterOptions {
        kv_blocks: 256,
        model: Some(dir.clone()),
        prefill_args,
        decode_args,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async move {
        let c = reqwest::Client::new();
        let mut tasks = Vec::new();
        for (p, want) in prompts.iter().zip(&expected) {
            let (c, url, p, want) = (c.clone(), url.clone(), p.clone(), want.clone());
            tasks.push(tokio::spawn(async move {
                let body = json!({"model": "test-model", "prompt": p, "max_tokens": 8, "temperature": 0});
                let resp: Value = c.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap();
                let n = resp["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                (resp, n, want, p.len() as u64)
            }));
        }
        for t in tasks {
            let (resp, n, want, prompt_len) = t.await.unwrap();
            assert_eq!(n as usize, want.len(), "completion length vs single process: {resp}");
            assert_eq!(resp["usage"]["prompt_tokens"].as_u64(), Some(prompt_len), "{resp}");
        }
        // Token-level equality: with one word per id, the text spells out the ids.
        for (p, want) in prompts.iter().zip(&expected) {
            let body = json!({"model": "test-model", "prompt": p, "max_tokens": 8, "temperature": 0});
            let resp: Value = c.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap();
            let text = resp["choices"][0]["text"].as_str().unwrap().to_string();
            let got: Vec<u64> = text.split_whitespace().map(|w| w.trim_start_matches('t').parse().unwrap()).collect();
            let eos_trimmed: Vec<u64> = want.clone(); // t2 is not a special token of this tokenizer, so it shows in the text
            assert_eq!(got, eos_trimmed, "P/D tokens differ from the single-process run ({text:?})");
        }
        // A KDA hybrid does not score prompts: `echo` with `logprobs` is a clear 400.
        let body = json!({"model": "test-model", "prompt": prompts[0], "max_tokens": 2, "echo": true, "logprobs": 1});
        let resp = c.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 400);
        let err: Value = resp.json().await.unwrap();
        assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("prompt log-probabilities")), "{err}");
        let w = tandem_e2e::workers_when_idle(&c, &url).await;
        let workers = w["workers"].as_array().unwrap();
        assert!(tandem_e2e::pools_full(&w, Some(8)), "state slots not returned: {w}");
        let decode = workers.iter().find(|x| x["role"] == "decode").unwrap();
        assert_eq!(decode["layout"], expected_decode_layout, "{w}");
        // The state handoffs (sized by the model's stated handoff size) fit the decode
        // worker's landing slots: they were written into shared memory, not sent over UCX.
        if tandem_e2e::shm_free_bytes() >= 32 << 20 {
            assert!(decode["kv_bytes_landed"].as_u64().unwrap_or(0) > 0, "no handoff landed: {w}");
        } else {
            eprintln!("not checking landing slots: /dev/shm has less than 32 MiB free");
        }
    });
}

fn admin_refresh(worker: &str, dir: &std::path::Path) -> std::process::Output {
    Command::new(tandem_bin())
        .args([
            "admin",
            "refresh-weights",
            "--worker",
            worker,
            "--model-dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap()
}

/// Weights refreshed on both running workers through the admin call: the cluster then answers
/// exactly as a single process on the new checkpoint does.
#[test]
fn refreshing_weights_on_running_workers_switches_the_answers() {
    refresh_case(Vec::new(), Vec::new());
}

/// The same with sharded workers (prefill tp 2, decode tp 2 × dp 2): every rank is refreshed.
#[test]
fn refreshing_weights_on_sharded_workers_switches_the_answers() {
    refresh_case(
        strings(&["--tp", "2"]),
        strings(&["--tp", "2", "--dp", "2"]),
    );
}

fn refresh_case(prefill_args: Vec<String>, decode_args: Vec<String>) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    synth_model_with_tokenizer(&a);
    std::fs::create_dir_all(&b).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(a.join(f), b.join(f)).unwrap();
    }
    perturb_embeddings(&a.join("model.safetensors"), &b.join("model.safetensors"));
    let prompt = vec![11u32, 40, 7, 200, 33];
    let before = single_process(&a, &prompt, 8);
    let after = single_process(&b, &prompt, 8);
    assert_ne!(
        before, after,
        "the refreshed checkpoint must answer differently"
    );
    let cluster = Cluster::start(ClusterOptions {
        kv_blocks: 8,
        model: Some(a.clone()),
        prefill_args,
        decode_args,
        ..ClusterOptions::default()
    });
    let ask = |url: &str| -> Vec<u64> {
        let body =
            json!({"model": "test-model", "prompt": prompt, "max_tokens": 8, "temperature": 0})
                .to_string();
        let v: Value = serde_json::from_str(&tandem_e2e::post_json(
            &format!("{url}/v1/completions"),
            &body,
        ))
        .unwrap();
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .map(|w| w.trim_start_matches('t').parse().unwrap())
            .collect()
    };
    assert_eq!(ask(&cluster.url), before);
    for worker in [&cluster.prefill_addr, &cluster.decode_addr] {
        let out = admin_refresh(worker, &b);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("refreshed"));
    }
    assert_eq!(ask(&cluster.url), after);
    // A missing checkpoint is refused with a reason, and the worker keeps serving.
    let out = admin_refresh(&cluster.decode_addr, &tmp.path().join("missing"));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(ask(&cluster.url), after);
}

/// Copies a safetensors file, scaling each element of `model.embed_tokens.weight` (F32) by a
/// factor that varies along the row, so the model's answers change.
fn perturb_embeddings(src: &std::path::Path, dst: &std::path::Path) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offs = header["model.embed_tokens.weight"]["data_offsets"]
        .as_array()
        .unwrap();
    let (s, e) = (
        offs[0].as_u64().unwrap() as usize + 8 + n,
        offs[1].as_u64().unwrap() as usize + 8 + n,
    );
    let mut out = bytes.clone();
    for (i, c) in out[s..e].chunks_exact_mut(4).enumerate() {
        let f = 1.0 + 0.5 * ((i % 7) as f32 - 3.0) / 3.0;
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * f;
        c.copy_from_slice(&v.to_le_bytes());
    }
    std::fs::write(dst, out).unwrap();
}

/// Clients that disconnect mid-stream: both workers get every state slot and latent block back.
#[test]
fn kda_cancelled_streams_free_slots_and_latent_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kda-tiny");
    synth_model_with_tokenizer(&dir);
    // Each request asks for nearly the whole 4,096-token context: the tiny model makes a
    // token in well under a millisecond, so a short request could finish in the time the
    // router takes to notice its client left, and would then not count as cancelled. A
    // request reserves 1,024 latent blocks at admission (2 MLA layers × latent and rope rows
    // × 256 blocks of 16 rows): the pool holds all four at once, so a request never waits on
    // its predecessor's release.
    let cluster = Cluster::start(ClusterOptions {
        kv_blocks: 4096,
        model: Some(dir),
        prefill_args: strings(&["--tp", "2", "--state-slots", "8"]),
        decode_args: strings(&["--tp", "2", "--dp", "2", "--state-slots", "8"]),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async move {
        let c = reqwest::Client::new();
        for i in 0..4u32 {
            let body = json!({"model": "test-model", "prompt": [5 + i, 40, 7], "max_tokens": 4090,
                              "ignore_eos": true, "temperature": 0, "stream": true});
            let resp = c.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            tandem_e2e::read_then_disconnect(resp, 300).await;
        }
        let w = tandem_e2e::workers_when_idle(&c, &url).await;
        assert!(tandem_e2e::pools_full(&w, Some(8)), "not freed after cancellations: {w}");
        // The decode worker dropped all four when their clients went away (rather than
        // generating their 4,090 tokens to the end).
        let decode = w["workers"].as_array().unwrap().iter().find(|x| x["role"] == "decode").unwrap();
        assert_eq!(decode["cancelled_requests"], 4, "{w}");
    });
}

/// A request whose MLA cache cannot fit the decode worker's latent pool is refused before its
/// first token (a 429 with an OpenAI-style error, streamed or not), takes nothing, and the
/// cluster goes on serving requests that fit.
#[test]
fn kda_requests_larger_than_the_latent_pool_are_refused_up_front() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kda-tiny");
    synth_model_with_tokenizer(&dir);
    // 256 blocks: a request of 3 + 500 tokens needs 2 MLA layers × 2 row kinds × 32 blocks
    // = 128 (fits); 3 + 2,000 tokens needs 2 × 2 × 126 = 504 (does not).
    let cluster = Cluster::start(ClusterOptions {
        kv_blocks: 256,
        model: Some(dir),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let c = reqwest::Client::new();
            let completions = format!("{url}/v1/completions");
            for stream in [false, true] {
                let body = json!({"model": "test-model", "prompt": [5, 40, 7], "max_tokens": 2000,
                              "temperature": 0, "stream": stream});
                let resp = c.post(&completions).json(&body).send().await.unwrap();
                assert_eq!(resp.status().as_u16(), 429, "stream={stream}");
                let err: Value = resp.json().await.unwrap();
                assert_eq!(err["error"]["code"], "capacity_exhausted", "{err}");
                let msg = err["error"]["message"].as_str().unwrap();
                assert!(msg.contains("need 504 blocks"), "{msg}");
            }
            let body = json!({"model": "test-model", "prompt": [5, 40, 7], "max_tokens": 500,
                          "ignore_eos": true, "temperature": 0});
            let v: Value = c
                .post(&completions)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(v["usage"]["completion_tokens"], 500, "{v}");
            let w = tandem_e2e::workers_when_idle(&c, &url).await;
            assert!(tandem_e2e::pools_full(&w, None), "{w}");
        });
}
