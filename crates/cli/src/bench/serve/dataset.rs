//! What a block sends: the random, JSONL and ShareGPT datasets, and when each request
//! leaves (seeded gamma-distributed gaps).

use super::ServeArgs;
use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Where the prompts come from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatasetName {
    /// Random token ids, lengths around `--random-input-len` / `--random-output-len`.
    Random,
    /// One JSON object a line: `{"prompt": "...", "output_tokens": N}` (`output_tokens`
    /// optional).
    Jsonl,
    /// A ShareGPT-format JSON file: each entry's first turn is the prompt, its second the
    /// reference reply (whose token count, with `--tokenizer`, is the output length).
    Sharegpt,
}

/// A prompt as sent.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One request of a block.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRequest {
    pub prompt: Prompt,
    /// Prompt tokens when known before sending (the server's usage figure wins).
    pub prompt_len: Option<usize>,
    pub output_len: u32,
}

/// Lengths drawn uniformly from `len * (1 - ratio) ..= len * (1 + ratio)`, at least 1.
fn length_range(len: f64, ratio: f64) -> (usize, usize) {
    let lo = (len * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = (len * (1.0 + ratio)).floor().max(lo as f64) as usize;
    (lo, hi)
}

/// The random dataset: `n` prompts of random token ids below `vocab`.
pub fn random_requests(
    n: usize,
    input_len: usize,
    output_len: u32,
    ratio: f64,
    vocab: u32,
    seed: u64,
) -> Vec<BenchRequest> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (in_lo, in_hi) = length_range(input_len as f64, ratio);
    let (out_lo, out_hi) = length_range(f64::from(output_len), ratio);
    (0..n)
        .map(|_| {
            let len = rng.random_range(in_lo..=in_hi);
            let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
            BenchRequest {
                prompt_len: Some(ids.len()),
                prompt: Prompt::Tokens(ids),
                output_len: rng.random_range(out_lo..=out_hi) as u32,
            }
        })
        .collect()
}

/// A JSONL file of `{"prompt": "...", "output_tokens": N}` lines (blank lines skipped).
pub fn read_jsonl(text: &str, output_len: Option<u32>) -> Result<Vec<BenchRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", i + 1))?;
        let prompt = v["prompt"]
            .as_str()
            .with_context(|| format!("line {}: no \"prompt\" string", i + 1))?;
        let len = match (output_len, v["output_tokens"].as_u64()) {
            (Some(n), _) => n,
            (None, Some(n)) => u32::try_from(n)?,
            (None, None) => bail!(
                "line {}: no \"output_tokens\" (give --output-len for every request)",
                i + 1
            ),
        };
        out.push(BenchRequest {
            prompt: Prompt::Text(prompt.to_string()),
            prompt_len: None,
            output_len: len,
        });
    }
    Ok(out)
}

/// Counts a reply's tokens (ShareGPT output lengths).
pub type ReplyLen<'a> = dyn Fn(&str) -> Result<usize> + 'a;

/// A ShareGPT file (a JSON list of `{"conversations": [{"from", "value"}, ...]}`): each
/// entry with two turns gives a prompt; its output length is `output_len`, else the
/// reference reply's token count by `reply_len`.
pub fn read_sharegpt(
    text: &str,
    output_len: Option<u32>,
    reply_len: Option<&ReplyLen<'_>>,
) -> Result<Vec<BenchRequest>> {
    let entries: Vec<Value> = serde_json::from_str(text).context("a ShareGPT JSON list")?;
    let mut out = Vec::new();
    for e in &entries {
        let turns = e["conversations"]
            .as_array()
            .or_else(|| e["conversation"].as_array());
        let Some([first, second, ..]) = turns.map(Vec::as_slice) else {
            continue;
        };
        let (Some(prompt), Some(reply)) = (first["value"].as_str(), second["value"].as_str())
        else {
            continue;
        };
        if prompt.is_empty() || reply.is_empty() {
            continue;
        }
        let len = match (output_len, reply_len) {
            (Some(n), _) => n,
            (None, Some(f)) => u32::try_from(f(reply)?.max(1))?,
            (None, None) => bail!("ShareGPT output lengths need --tokenizer or --output-len"),
        };
        out.push(BenchRequest {
            prompt: Prompt::Text(prompt.to_string()),
            prompt_len: None,
            output_len: len,
        });
    }
    Ok(out)
}

/// `n` requests from `pool`: in order for JSONL, after a seeded shuffle for ShareGPT,
/// cycling when the file holds fewer.
fn take(
    mut pool: Vec<BenchRequest>,
    n: usize,
    shuffle_seed: Option<u64>,
) -> Result<Vec<BenchRequest>> {
    if pool.is_empty() {
        bail!("the dataset holds no usable prompt");
    }
    if let Some(seed) = shuffle_seed {
        let mut rng = StdRng::seed_from_u64(seed);
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.random_range(0..=i));
        }
    }
    Ok((0..n).map(|i| pool[i % pool.len()].clone()).collect())
}

fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    tokenizers::Tokenizer::from_file(&file)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", file.display()))
}

/// The requests every block sends, from the arguments.
pub fn dataset(args: &ServeArgs, chat: bool) -> Result<Vec<BenchRequest>> {
    let tok = args.tokenizer.as_deref().map(load_tokenizer).transpose()?;
    let read = |p: &Option<PathBuf>| -> Result<String> {
        let p = p.as_ref().context("--dataset-path is needed")?;
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
    };
    match args.dataset_name {
        DatasetName::Random => {
            let vocab = tok
                .as_ref()
                .map_or(args.random_vocab, |t| t.get_vocab_size(true) as u32);
            let mut reqs = random_requests(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                vocab,
                args.seed,
            );
            if chat {
                let t = tok.as_ref().context(
                    "the random dataset on a chat endpoint needs --tokenizer (to send text)",
                )?;
                for r in &mut reqs {
                    if let Prompt::Tokens(ids) = &r.prompt {
                        let text = t.decode(ids, false).map_err(|e| anyhow::anyhow!("{e}"))?;
                        r.prompt = Prompt::Text(text);
                        r.prompt_len = None;
                    }
                }
            }
            Ok(reqs)
        }
        DatasetName::Jsonl => take(
            read_jsonl(&read(&args.dataset_path)?, args.output_len)?,
            args.num_prompts,
            None,
        ),
        DatasetName::Sharegpt => {
            let count = |s: &str| -> Result<usize> {
                let t = tok.as_ref().context("no tokenizer")?;
                Ok(t.encode(s, false)
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .len())
            };
            let f: &ReplyLen<'_> = &count;
            let reqs = read_sharegpt(
                &read(&args.dataset_path)?,
                args.output_len,
                tok.as_ref().map(|_| f),
            )?;
            take(reqs, args.num_prompts, Some(args.seed))
        }
    }
}

// Arrivals

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A Gamma(`shape`, `scale`) draw (Marsaglia and Tsang; shapes below 1 by the boost
/// `Gamma(k) = Gamma(k + 1) * U^(1/k)`).
fn gamma(rng: &mut StdRng, shape: f64, scale: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = 1.0 - rng.random::<f64>();
        return gamma(rng, shape + 1.0, scale) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = 1.0 - rng.random::<f64>();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v * scale;
        }
    }
}

/// When each of `n` requests is sent, seconds from the block's start: the first at 0, then
/// gaps drawn from Gamma(shape `burstiness`, mean `1 / rate`) — exponential (a Poisson
/// process) at burstiness 1; all at 0 at an infinite rate.
pub fn arrival_times(n: usize, rate: f64, burstiness: f64, seed: u64) -> Vec<f64> {
    if !rate.is_finite() {
        return vec![0.0; n];
    }
    // Its own stream, so the dataset's draws do not move with the rate.
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6172_7269_7661_6c73);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gamma(&mut rng, burstiness, 1.0 / (rate * burstiness));
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::serve::stats::{mean, std_dev};

    #[test]
    fn random_dataset_is_seeded_and_within_its_ranges() {
        let a = random_requests(50, 100, 20, 0.5, 1000, 7);
        assert_eq!(a, random_requests(50, 100, 20, 0.5, 1000, 7));
        assert_ne!(a, random_requests(50, 100, 20, 0.5, 1000, 8));
        for r in &a {
            let Prompt::Tokens(ids) = &r.prompt else {
                panic!("token ids expected");
            };
            assert!((50..=150).contains(&ids.len()));
            assert_eq!(r.prompt_len, Some(ids.len()));
            assert!(ids.iter().all(|&t| t < 1000));
            assert!((10..=30).contains(&r.output_len));
        }
        let exact = random_requests(5, 16, 8, 0.0, 1000, 1);
        assert!(exact
            .iter()
            .all(|r| r.prompt_len == Some(16) && r.output_len == 8));
    }

    #[test]
    fn jsonl_reads_prompts_and_lengths() {
        let text = "{\"prompt\": \"hi\", \"output_tokens\": 5}\n\n{\"prompt\": \"yo\", \"output_tokens\": 7}\n";
        let r = read_jsonl(text, None).expect("valid");
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].prompt, Prompt::Text("yo".into()));
        assert_eq!(r[1].output_len, 7);
        assert!(read_jsonl(text, Some(3))
            .expect("valid")
            .iter()
            .all(|r| r.output_len == 3));
        assert!(read_jsonl("{\"prompt\": \"hi\"}", None).is_err());
        assert!(read_jsonl("{\"text\": \"hi\"}", Some(3)).is_err());
        assert!(read_jsonl("not json", Some(3)).is_err());
    }

    #[test]
    fn sharegpt_takes_first_turn_as_prompt_and_skips_short_entries() {
        let text = r#"[
            {"conversations": [{"from": "human", "value": "Hello there"},
                               {"from": "gpt", "value": "one two three"}]},
            {"conversations": [{"from": "human", "value": "alone"}]},
            {"conversations": [{"from": "human", "value": ""},
                               {"from": "gpt", "value": "x"}]}
        ]"#;
        let words = |s: &str| -> Result<usize> { Ok(s.split_whitespace().count()) };
        let f: &dyn Fn(&str) -> Result<usize> = &words;
        let r = read_sharegpt(text, None, Some(f)).expect("valid");
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].prompt, Prompt::Text("Hello there".into()));
        assert_eq!(r[0].output_len, 3);
        assert_eq!(
            read_sharegpt(text, Some(9), None).expect("valid")[0].output_len,
            9
        );
        assert!(read_sharegpt(text, None, None).is_err());
        assert!(read_sharegpt("{}", Some(1), None).is_err());

        let pool: Vec<BenchRequest> = (0..5)
            .map(|i| BenchRequest {
                prompt: Prompt::Text(i.to_string()),
                prompt_len: None,
                output_len: 1,
            })
            .collect();
        let cycled = take(pool.clone(), 7, None).expect("valid");
        assert_eq!(cycled[5], pool[0]);
        let shuffled = take(pool.clone(), 5, Some(3)).expect("valid");
        assert_eq!(shuffled, take(pool.clone(), 5, Some(3)).expect("valid"));
        assert!(take(Vec::new(), 1, None).is_err());
    }

    #[test]
    fn arrivals_are_seeded_with_mean_gap_one_over_rate_and_gamma_spread() {
        assert_eq!(arrival_times(3, f64::INFINITY, 1.0, 0), [0.0; 3]);
        let a = arrival_times(100, 10.0, 1.0, 5);
        assert_eq!(a, arrival_times(100, 10.0, 1.0, 5));
        assert_ne!(a, arrival_times(100, 10.0, 1.0, 6));
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        // Gamma(k, 1 / (rate k)): mean 1 / rate, squared coefficient of variation 1 / k.
        for burstiness in [0.5, 1.0, 4.0] {
            let t = arrival_times(40_001, 20.0, burstiness, 11);
            let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            let m = mean(&gaps);
            let cv2 = (std_dev(&gaps) / m).powi(2);
            assert!(
                (m * 20.0 - 1.0).abs() < 0.03,
                "mean gap {m} at {burstiness}"
            );
            assert!(
                (cv2 * burstiness - 1.0).abs() < 0.08,
                "cv² {cv2} at {burstiness}"
            );
        }
    }
}
