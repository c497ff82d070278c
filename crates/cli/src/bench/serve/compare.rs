//! Arms compared in order: parsing `--arms`, `--order` and `--gate`, the gate's verdict
//! (each term in its figure's good direction), and the output identity check.

use super::stats::{Metrics, RequestOutput};
use anyhow::{bail, Context, Result};

/// A server under comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arm {
    pub name: String,
    pub url: String,
}

/// `A=http://host:port`.
pub fn parse_arm(s: &str) -> Result<Arm, String> {
    let (name, url) = s
        .split_once('=')
        .ok_or_else(|| format!("{s}: expected NAME=URL"))?;
    if name.is_empty() || url.is_empty() {
        return Err(format!("{s}: expected NAME=URL"));
    }
    Ok(Arm {
        name: name.to_string(),
        url: url.trim_end_matches('/').to_string(),
    })
}

/// The order as indices into `arms`: letters (`ABBA`) or comma-separated names.
pub fn parse_order(order: &str, arms: &[Arm]) -> Result<Vec<usize>> {
    let names: Vec<String> = if order.contains(',') {
        order.split(',').map(|s| s.trim().to_string()).collect()
    } else {
        order.chars().map(String::from).collect()
    };
    let idx = names
        .iter()
        .map(|n| {
            arms.iter()
                .position(|a| &a.name == n)
                .with_context(|| format!("--order names {n}, which --arms does not"))
        })
        .collect::<Result<Vec<_>>>()?;
    for (i, a) in arms.iter().enumerate() {
        if !idx.contains(&i) {
            bail!("arm {} is not in --order {order}", a.name);
        }
    }
    Ok(idx)
}

/// One term of `--gate`: `figure:+1%`.
#[derive(Clone, Debug, PartialEq)]
pub struct GateTerm {
    pub figure: String,
    /// The least change allowed, percent, positive meaning better.
    pub percent: f64,
}

/// Whether more of a figure is better (throughputs, goodput) or less (latencies).
fn higher_is_better(figure: &str) -> bool {
    figure.contains("throughput") || figure.contains("goodput")
}

/// `throughput:+1%`, `ttft_p95:-5%`.
pub fn parse_gate_term(s: &str) -> Result<GateTerm, String> {
    let (figure, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{s}: expected FIGURE:+N%"))?;
    let percent: f64 = value
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{value}: expected a signed percentage such as +1%"))?;
    if Metrics::default().figure(figure).is_none() && !figure.contains("goodput") {
        return Err(format!(
            "{figure}: a gate names throughput, request_throughput, goodput or \
             ttft|tpot|itl|e2el_mean|median|pNN"
        ));
    }
    Ok(GateTerm {
        figure: figure.to_string(),
        percent,
    })
}

/// A candidate's change against a baseline, percent, positive meaning better.
pub fn improvement(figure: &str, candidate: f64, baseline: f64) -> f64 {
    if baseline == 0.0 {
        return 0.0;
    }
    let change = (candidate - baseline) / baseline * 100.0;
    if higher_is_better(figure) {
        change
    } else {
        -change
    }
}

/// One comparison a verdict rests on.
#[derive(Clone, Debug)]
pub struct GateCheck {
    pub candidate: String,
    pub baseline: String,
    pub figure: String,
    pub improvement: f64,
    pub needed: f64,
    pub passed: bool,
}

/// Every gate term for every candidate against every baseline position.
pub fn judge(
    gate: &[GateTerm],
    candidates: &[(String, &Metrics)],
    baselines: &[(String, &Metrics)],
) -> Vec<GateCheck> {
    let mut out = Vec::new();
    for (cname, c) in candidates {
        for (bname, b) in baselines {
            for term in gate {
                let (Some(cv), Some(bv)) = (c.figure(&term.figure), b.figure(&term.figure)) else {
                    out.push(GateCheck {
                        candidate: cname.clone(),
                        baseline: bname.clone(),
                        figure: term.figure.clone(),
                        improvement: f64::NAN,
                        needed: term.percent,
                        passed: false,
                    });
                    continue;
                };
                let imp = improvement(&term.figure, cv, bv);
                out.push(GateCheck {
                    candidate: cname.clone(),
                    baseline: bname.clone(),
                    figure: term.figure.clone(),
                    improvement: imp,
                    needed: term.percent,
                    passed: imp >= term.percent,
                });
            }
        }
    }
    out
}

/// Whether every block's outputs equal the reference's, request by request: `None` when
/// they do, else the first request index that differs (or failed).
pub fn first_difference(
    reference: &[RequestOutput],
    blocks: &[Vec<RequestOutput>],
) -> Option<usize> {
    for block in blocks {
        for (i, (r, o)) in reference.iter().zip(block).enumerate() {
            if !r.success || !o.success || r.text.as_bytes() != o.text.as_bytes() {
                return Some(i);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft: f64, latency: f64, output_len: usize, text: &str) -> RequestOutput {
        RequestOutput {
            success: true,
            ttft,
            latency,
            output_len,
            prompt_len: 10,
            itl: vec![(latency - ttft) / output_len.max(2) as f64; output_len.saturating_sub(1)],
            text: text.into(),
            ..Default::default()
        }
    }

    #[test]
    fn gate_terms_parse_and_judge_in_each_figure_s_good_direction() {
        let gate: Vec<GateTerm> = "throughput:+1%,ttft_p95:-5%"
            .split(',')
            .map(|t| parse_gate_term(t).expect("valid"))
            .collect();
        assert_eq!(gate[0].percent, 1.0);
        assert_eq!(gate[1].percent, -5.0);
        assert!(parse_gate_term("throughput").is_err());
        assert!(parse_gate_term("speed:+1%").is_err());
        assert!(parse_gate_term("ttft_p95:lots").is_err());
        assert!(parse_gate_term("e2el_p99.9:-2%").is_ok());

        assert!((improvement("throughput", 101.5, 100.0) - 1.5).abs() < 1e-9);
        assert!((improvement("ttft_p95", 104.0, 100.0) + 4.0).abs() < 1e-9);

        // A baseline with throughput 10 tok/s and TTFTs of 100 ms; candidates faster by 2%
        // with TTFT 4% worse (passes), and faster by 2% with TTFT 6% worse (fails).
        let run = |duration: f64, ttft: f64| {
            let outs: Vec<RequestOutput> = (0..10).map(|_| ok(ttft, 1.0, 10, "")).collect();
            Metrics::of(&outs, duration, &[95.0], &[])
        };
        let base = ("A0".to_string(), &run(10.0, 0.100));
        let (good, slow) = (run(9.8, 0.104), run(9.8, 0.106));
        let candidates = [("B".to_string(), &good), ("C".to_string(), &slow)];
        let checks = judge(&gate, &candidates, std::slice::from_ref(&base));
        assert_eq!(checks.len(), 4);
        let passed = |arm: &str| {
            checks
                .iter()
                .filter(|c| c.candidate == arm)
                .map(|c| c.passed)
                .collect::<Vec<_>>()
        };
        assert_eq!(passed("B"), [true, true]);
        assert_eq!(passed("C"), [true, false]);
    }

    #[test]
    fn arms_and_orders_parse() {
        let arms: Vec<Arm> = ["A=http://a:1/", "B=http://b:2"]
            .iter()
            .map(|s| parse_arm(s).expect("valid"))
            .collect();
        assert_eq!(arms[0].url, "http://a:1");
        assert!(parse_arm("http://a:1").is_err());
        assert!(parse_arm("A=").is_err());
        assert_eq!(parse_order("ABBA", &arms).expect("valid"), [0, 1, 1, 0]);
        assert_eq!(parse_order("A,B,B,A", &arms).expect("valid"), [0, 1, 1, 0]);
        assert!(parse_order("ABCA", &arms).is_err());
        assert!(parse_order("AA", &arms).is_err());
    }

    #[test]
    fn identity_finds_the_first_differing_or_failed_request() {
        let reference = vec![ok(0.1, 1.0, 2, "ab"), ok(0.1, 1.0, 2, "cd")];
        assert_eq!(
            first_difference(&reference, std::slice::from_ref(&reference)),
            None
        );
        let mut other = reference.clone();
        other[1].text = "ce".into();
        assert_eq!(
            first_difference(&reference, &[reference.clone(), other]),
            Some(1)
        );
        let mut failed = reference.clone();
        failed[0].success = false;
        assert_eq!(first_difference(&reference, &[failed]), Some(0));
    }
}
