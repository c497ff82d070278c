//! Sampling controls through the OpenAI API (`presence_penalty`, `frequency_penalty`,
//! `repetition_penalty`, `logit_bias`, `min_p`, `min_tokens`), on SmolLM2 with its real
//! weights: each changes the output where it must, and a P/D pair (the prefill worker samples
//! the first token, the decode worker the rest) answers exactly as an aggregated worker (one
//! process) does, greedy and seeded. The official `openai` client sends them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use tandem_e2e::{post, python, rt, Cluster, ClusterOptions};

/// A prompt whose greedy continuation repeats itself: penalties must change it.
const LOOP: &str = "one two one two one two one two one two";

async fn complete(c: &reqwest::Client, url: &str, extra: Value) -> Value {
    let mut body = json!({"prompt": LOOP, "max_tokens": 24, "temperature": 0});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    let (status, v) = post(c, &format!("{url}/v1/completions"), body.clone()).await;
    assert_eq!(status, 200, "{body} -> {v}");
    v
}

/// A P/D cluster and an aggregated worker (one process) serving the same model.
fn pd_and_one() -> (Cluster, Cluster) {
    let pd = Cluster::start(ClusterOptions::default());
    let one = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        ..ClusterOptions::default()
    });
    (pd, one)
}

/// Two lists of log-probabilities of the same tokens agree (P/D against one process).
fn close(a: &Value, b: &Value) -> bool {
    let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3)
}

/// Every choice's text, in order.
fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["text"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

#[test]
fn sampling_controls_change_the_output_and_pd_equals_one_process() {
    let (pd, one) = pd_and_one();
    let (pd_url, one_url) = (pd.url.clone(), one.url.clone());
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let plain = text(&complete(&c, &one_url, json!({})).await);
        let seeded = json!({"temperature": 1.2, "seed": 7});
        let cases = [
            ("presence_penalty", json!({"presence_penalty": 2.0})),
            ("frequency_penalty", json!({"frequency_penalty": 2.0})),
            ("repetition_penalty", json!({"repetition_penalty": 1.8})),
            ("seeded", seeded.clone()),
            (
                "min_p",
                json!({"temperature": 1.2, "seed": 7, "min_p": 0.3}),
            ),
            (
                "seeded penalties",
                json!({"temperature": 1.2, "seed": 7, "frequency_penalty": 1.0,
                       "logit_bias": {"28": -100}}),
            ),
        ];
        let mut outputs = Vec::new();
        for (name, extra) in &cases {
            let a = text(&complete(&c, &one_url, extra.clone()).await);
            let b = text(&complete(&c, &pd_url, extra.clone()).await);
            assert_eq!(a, b, "{name}: P/D differs from one process");
            outputs.push((name, a));
        }
        for (name, out) in &outputs[..3] {
            assert_ne!(out, &plain, "{name} did not change a repeating output");
        }
        assert_ne!(
            outputs[4].1, outputs[3].1,
            "min_p did not change a hot seeded sample"
        );
        // A bias of +100 forces one token at every step.
        for url in [&pd_url, &one_url] {
            let v = complete(
                &c,
                url,
                json!({"max_tokens": 6, "logit_bias": {"1000": 100}}),
            )
            .await;
            let t = text(&v);
            assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
            let unit = &t[..t.len() / 6];
            assert!(
                !unit.is_empty() && t == unit.repeat(6),
                "{t:?} is not one token 6 times"
            );
        }
        // Batched prompts: one choice per prompt, each what that prompt gets alone.
        let prompts = ["The capital of France is", LOOP, "1, 2, 3,"];
        let v = complete(&c, &pd_url, json!({"prompt": prompts, "max_tokens": 8})).await;
        for (i, p) in prompts.iter().enumerate() {
            let alone = complete(&c, &pd_url, json!({"prompt": p, "max_tokens": 8})).await;
            assert_eq!(v["choices"][i]["index"], i, "{v}");
            assert_eq!(v["choices"][i]["text"], alone["choices"][0]["text"], "{v}");
        }
        // n = 3 with a seed: three reproducible samples, the same through P/D and one process.
        let three = json!({"n": 3, "seed": 11, "temperature": 1.3, "max_tokens": 12});
        let a = complete(&c, &pd_url, three.clone()).await;
        let b = complete(&c, &one_url, three.clone()).await;
        let again = complete(&c, &pd_url, three.clone()).await;
        assert_eq!(texts(&a).len(), 3, "{a}");
        assert_eq!(texts(&a), texts(&b), "P/D differs from one process");
        assert_eq!(texts(&a), texts(&again), "a seed repeats");
        let mut distinct = texts(&a);
        distinct.dedup();
        assert!(
            distinct.len() > 1,
            "three samples at temperature 1.3 all equal: {a}"
        );
        let single = complete(&c, &pd_url, json!({"max_tokens": 12})).await;
        assert_eq!(
            a["usage"]["prompt_tokens"], single["usage"]["prompt_tokens"],
            "prompt once"
        );
        // min_tokens holds EOS back: the chat answer goes on past its usual end.
        let chat = |min: u32| {
            json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                   "max_tokens": 40, "temperature": 0, "min_tokens": min})
        };
        for url in [&pd_url, &one_url] {
            let chat_url = format!("{url}/v1/chat/completions");
            let (_, short) = post(&c, &chat_url, chat(0)).await;
            let (_, long) = post(&c, &chat_url, chat(30)).await;
            let n = |v: &Value| v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            assert!(n(&short) < 30, "{short}");
            assert!(n(&long) >= 30, "min_tokens 30 gave {long}");
        }
        for url in [&pd_url, &one_url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
    });
    // The official client sends them as OpenAI defines them (extensions in extra_body).
    let script = format!(
        r#"
import openai
def run(url, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = c.completions.create(model="smollm2-135m-instruct", prompt="{LOOP}",
        max_tokens=16, temperature=0, **kw)
    return r.choices[0].text
kw = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={{"28": -100}},
          extra_body={{"repetition_penalty": 1.2, "min_tokens": 8}})
a, b = run("{pd}", **kw), run("{one}", **kw)
assert a == b, (a, b)
assert a != run("{one}"), a
try:
    run("{pd}", presence_penalty=3)
    raise SystemExit("presence_penalty 3 was accepted")
except openai.BadRequestError as e:
    assert "presence_penalty" in str(e), e
# n = 3 with a seed: three distinct samples, the same again; best_of = 3 picks one of them.
c = openai.OpenAI(base_url="{pd}/v1", api_key="unused")
ask = dict(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5)
three = c.completions.create(n=3, **ask)
texts = [ch.text for ch in three.choices]
assert [ch.index for ch in three.choices] == [0, 1, 2] and len(set(texts)) > 1, three
assert [ch.text for ch in c.completions.create(n=3, **ask).choices] == texts
alone = c.completions.create(**ask)
assert three.usage.prompt_tokens == alone.usage.prompt_tokens, (three.usage, alone.usage)
best = c.completions.create(n=1, best_of=3, **ask)
assert len(best.choices) == 1 and best.choices[0].text in texts, (best, texts)
print("ok", repr(a), texts)
"#,
        pd = pd.url,
        one = one.url
    );
    python(&script, &pd);
}

/// Log-probabilities: greedy tokens carry the top log-probability, alternatives come most
/// likely first, streamed chunks carry their own tokens' entries, completions use the
/// legacy shape, and a P/D pair reports what one process does.
#[test]
fn logprobs_follow_openai_shapes_and_pd_equals_one_process() {
    let (pd, one) = pd_and_one();
    let (pd_url, one_url) = (pd.url.clone(), one.url.clone());
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let body = json!({"prompt": "The capital of France is", "max_tokens": 6,
                          "temperature": 0, "logprobs": 3});
        let mut got = Vec::new();
        for url in [&pd_url, &one_url] {
            let (_, v) = post(&c, &format!("{url}/v1/completions"), body.clone()).await;
            let lp = &v["choices"][0]["logprobs"];
            let tokens = lp["tokens"].as_array().expect("tokens");
            assert_eq!(tokens.len(), 6, "{v}");
            let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
            assert_eq!(joined, text(&v), "the tokens spell the text");
            let offsets: Vec<u64> = lp["text_offset"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_u64().unwrap())
                .collect();
            assert_eq!(offsets[0], 0);
            assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
            for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
                let top = top.as_object().unwrap();
                let best = top
                    .values()
                    .map(|x| x.as_f64().unwrap())
                    .fold(f64::MIN, f64::max);
                let chosen = lp["token_logprobs"][i].as_f64().unwrap();
                assert!(chosen <= 0.0);
                assert!((chosen - best).abs() < 1e-6, "greedy picks the best: {v}");
            }
            got.push(lp["token_logprobs"].clone());
        }
        assert!(
            close(&got[0], &got[1]),
            "P/D {} vs one process {}",
            got[0],
            got[1]
        );
        // `echo` with `logprobs`: the prompt's tokens first (the first one's null), computed
        // by the prefill worker on P/D; the same as one process, and the answer's entries the
        // same as without `echo`.
        let mut echoed = Vec::new();
        for url in [&pd_url, &one_url] {
            let mut with_echo = body.clone();
            with_echo["echo"] = json!(true);
            let (_, v) = post(&c, &format!("{url}/v1/completions"), with_echo).await;
            let lp = &v["choices"][0]["logprobs"];
            let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
            let entries = lp["token_logprobs"].as_array().expect("token_logprobs");
            assert_eq!(entries.len(), prompt_tokens + 6, "{v}");
            assert!(
                entries[0].is_null() && lp["top_logprobs"][0].is_null(),
                "{v}"
            );
            assert!(
                entries[1..]
                    .iter()
                    .all(|e| e.as_f64().is_some_and(|l| l <= 0.0)),
                "{v}"
            );
            let joined: String = lp["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect();
            assert_eq!(
                joined,
                text(&v),
                "the prompt's and the answer's tokens spell the text"
            );
            assert_eq!(
                &Value::from(entries[prompt_tokens..].to_vec()),
                &got[0],
                "{v}"
            );
            echoed.push(Value::from(entries[1..prompt_tokens].to_vec()));
        }
        assert!(
            close(&echoed[0], &echoed[1]),
            "P/D {} vs one process {}",
            echoed[0],
            echoed[1]
        );
        for url in [&pd_url, &one_url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
    });
    let script = format!(
        r#"
import openai
c = openai.OpenAI(base_url="{pd}/v1", api_key="unused")
msgs = [{{"role": "user", "content": "What is the capital of France?"}}]
r = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=8, temperature=0,
    logprobs=True, top_logprobs=4)
content = r.choices[0].logprobs.content
# The tokens spell the text, then the end-of-turn token that ended it (reported, not shown).
joined = "".join(t.token for t in content)
assert joined in (r.choices[0].message.content, r.choices[0].message.content + "<|im_end|>"), content
for t in content:
    tops = [x.logprob for x in t.top_logprobs]
    assert len(tops) == 4 and tops == sorted(tops, reverse=True), tops
    assert t.token == t.top_logprobs[0].token and abs(t.logprob - tops[0]) < 1e-6, t
    assert bytes(t.bytes) == t.token.encode()
s = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=8, temperature=0,
    logprobs=True, top_logprobs=2, stream=True)
streamed, text = [], ""
for ch in s:
    if ch.choices and ch.choices[0].logprobs:
        streamed += ch.choices[0].logprobs.content
    if ch.choices and ch.choices[0].delta.content:
        text += ch.choices[0].delta.content
assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
assert text == r.choices[0].message.content
plain = c.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, max_tokens=4, temperature=0)
assert plain.choices[0].logprobs is None
# echo with logprobs: the prompt's tokens and theirs (the first one's None), whole and streamed.
p = "The capital of France is"
e = c.completions.create(model="smollm2-135m-instruct", prompt=p, max_tokens=3, temperature=0,
    echo=True, logprobs=2)
lp, n = e.choices[0].logprobs, e.usage.prompt_tokens
assert e.choices[0].text.startswith(p) and "".join(lp.tokens) == e.choices[0].text, lp
assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
assert all(l <= 0 for l in lp.token_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset), lp
assert all(len(t) == 2 for t in lp.top_logprobs[1:]), lp
s = c.completions.create(model="smollm2-135m-instruct", prompt=p, max_tokens=3, temperature=0,
    echo=True, logprobs=2, stream=True)
chunks = [ch.choices[0] for ch in s if ch.choices]
assert chunks[0].text == p and chunks[0].logprobs.tokens == lp.tokens[:n], chunks[0]
assert chunks[0].logprobs.token_logprobs == lp.token_logprobs[:n], chunks[0]
assert "".join(ch.text for ch in chunks) == e.choices[0].text
print("ok")
"#,
        pd = pd.url
    );
    python(&script, &pd);
}

/// API keys from a file: the official client gets 401 (`AuthenticationError`) without one
/// or with a wrong one, answers with a good one, a key written into the file works at once
/// and a removed one stops working; probes stay open.
#[test]
fn api_keys_guard_the_api_and_rotate_from_their_file() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# test keys\nsk-first\n").unwrap();
    let cluster = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        router_config: format!("auth:\n  api_keys_file: {}\n", keys.display()),
        ..ClusterOptions::default()
    });
    let run = |key: &str, expect: &str| {
        let script = format!(
            r#"
import openai
c = openai.OpenAI(base_url="{url}/v1", api_key="{key}")
try:
    r = c.completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=2)
    got = "ok"
except openai.AuthenticationError as e:
    assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
    got = "401"
assert got == "{expect}", got
"#,
            url = cluster.url
        );
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(&script)
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "key {key:?}, expected {expect}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run("sk-first", "ok");
    run("sk-wrong", "401");
    std::fs::write(&keys, "sk-second\n").unwrap();
    run("sk-second", "ok");
    run("sk-first", "401");
    rt().block_on(async {
        let c = reqwest::Client::new();
        let health = c
            .get(format!("{}/health", cluster.url))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), 200, "probes stay open");
        let admin = c
            .get(format!("{}/admin/workers", cluster.url))
            .send()
            .await
            .unwrap();
        assert_eq!(admin.status(), 401, "admin routes need a key");
    });
}

/// The `prefill_tokens` counter of the worker at gRPC address `addr`.
async fn prefill_tokens(addr: &str) -> u64 {
    let mut w = tandem_proto::v1::worker_client::WorkerClient::connect(addr.to_string())
        .await
        .expect("connect");
    w.stats(tandem_proto::v1::StatsRequest::default())
        .await
        .expect("stats")
        .into_inner()
        .prefill_tokens
}

/// The texts of a streamed completion's choices, by `index`.
async fn streamed_texts(c: &reqwest::Client, url: &str, body: Value, n: usize) -> Vec<String> {
    let resp = c
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), 200);
    let sse = resp.text().await.expect("the stream");
    let mut texts = vec![String::new(); n];
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(line).expect("a JSON chunk");
        for choice in chunk["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            texts[i].push_str(choice["text"].as_str().unwrap_or_default());
        }
    }
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
    texts
}

/// `n` choices compute their prompt once (the prefill worker's, or the aggregated worker's,
/// prompt-token counter moves by one prompt), then decode apart over the decode worker's
/// shared blocks: each choice equals the request with its seed alone (`seed + index`),
/// streamed equals whole, P/D equals one process, and the pools end whole.
#[test]
fn n_choices_share_one_prefill_and_each_equals_its_seed_alone() {
    let (pd, one) = pd_and_one();
    let (pd_url, one_url) = (pd.url.clone(), one.url.clone());
    let (prefill, aggregated) = (pd.prefill_addr.clone(), one.aggregated_addr.clone());
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let prompt = "The old lighthouse keeper looked out at the sea and said";
        let body = |n: u32, seed: u64| {
            json!({"prompt": prompt, "n": n, "seed": seed, "temperature": 1.1,
                   "max_tokens": 10, "ignore_eos": true})
        };
        let mut answers = Vec::new();
        for (url, worker) in [(&pd_url, &prefill), (&one_url, &aggregated)] {
            let before = prefill_tokens(worker).await;
            let v = complete(&c, url, body(4, 21)).await;
            let computed = prefill_tokens(worker).await - before;
            assert_eq!(
                json!(computed),
                v["usage"]["prompt_tokens"],
                "{url}: 4 choices computed the prompt {computed} tokens' worth: {v}"
            );
            assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
            let got = texts(&v);
            for (j, want) in got.iter().enumerate() {
                let alone = complete(&c, url, body(1, 21 + j as u64)).await;
                assert_eq!(
                    &text(&alone),
                    want,
                    "{url}: choice {j} differs from its seed alone"
                );
            }
            let mut streamed = body(4, 21);
            streamed["stream"] = json!(true);
            let streamed = streamed_texts(&c, url, streamed, 4).await;
            assert_eq!(streamed, got, "{url}: streamed differs from whole");
            // best_of = 4, n = 2: the two of those four whose tokens are the most likely on
            // average, most likely first; all four generated (and counted), the prompt once.
            let mut scored = body(4, 21);
            scored["logprobs"] = json!(0);
            let scored = complete(&c, url, scored).await;
            assert_eq!(texts(&scored), got, "{url}: logprobs changed the samples");
            let mean = |choice: &Value| {
                let lps = choice["logprobs"]["token_logprobs"]
                    .as_array()
                    .expect("token_logprobs");
                lps.iter().filter_map(Value::as_f64).sum::<f64>() / lps.len() as f64
            };
            let mut ranked: Vec<(f64, String)> = scored["choices"]
                .as_array()
                .expect("choices")
                .iter()
                .map(|choice| {
                    (
                        mean(choice),
                        choice["text"].as_str().unwrap_or_default().into(),
                    )
                })
                .collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
            let mut best = body(2, 21);
            best["best_of"] = json!(4);
            let before = prefill_tokens(worker).await;
            let best = complete(&c, url, best).await;
            let computed = prefill_tokens(worker).await - before;
            assert_eq!(
                json!(computed),
                best["usage"]["prompt_tokens"],
                "{url}: {best}"
            );
            assert_eq!(best["usage"]["completion_tokens"], 40, "{best}");
            let want: Vec<String> = ranked.iter().take(2).map(|(_, t)| t.clone()).collect();
            assert_eq!(texts(&best), want, "{url}: best_of kept others: {ranked:?}");
            assert_ne!(
                want[..],
                got[..2],
                "the seeds' own order ranks them: no check"
            );
            for (i, choice) in best["choices"]
                .as_array()
                .expect("choices")
                .iter()
                .enumerate()
            {
                assert_eq!(choice["index"], i, "{best}");
                assert!(choice["logprobs"].is_null(), "not asked for: {best}");
            }
            answers.push(got);
        }
        assert_eq!(answers[0], answers[1], "P/D differs from one process");
        let mut distinct = answers[0].clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 1, "four samples all equal: {distinct:?}");
        for url in [&pd_url, &one_url] {
            let workers = tandem_e2e::workers_when_idle(&c, url).await;
            assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        }
    });
}
