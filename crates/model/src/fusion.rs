//! Whether a KDA layer's projections may be fused, decided once per layer at load from the
//! ORIGINAL projection names (fusion renames nothing the quantization config or a LoRA
//! adapter refers to).
//!
//! Two groups: the input GEMM `[q|k|v|b|f_a|g_a]` and the paired batched matmul `[f_b|g_b]`.
//! A group is fused only when every constituent is unquantized (per the checkpoint's ignore
//! list under exact, `model.`-prefix-normalised matching), shares one dtype, and no LoRA
//! adapter targets any of them. A quantization method other than the native block FP8 keeps
//! the original projections. A mixed group falls back to unfused — never an error.

use serde_json::Value;

/// Constituents of the fused input projection, in fused order.
pub const INPUT_GROUP: [&str; 6] = [
    "q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj",
];
/// Constituents of the paired batched matmul.
pub const FG_B_GROUP: [&str; 2] = ["f_b_proj", "g_b_proj"];

/// The checkpoint's `quantization_config`, as far as fusion cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizationConfig {
    /// `quant_method` (`fp8` is the native block-FP8 method).
    pub method: String,
    /// Modules left unquantized: `ignored_layers`, else `modules_to_not_convert`.
    pub ignored: Vec<String>,
}

fn strip_model_prefix(name: &str) -> &str {
    name.strip_prefix("model.").unwrap_or(name)
}

impl QuantizationConfig {
    /// Reads `quantization_config` from a parsed `config.json`; `None` when absent.
    pub fn from_config(config: &Value) -> Option<Self> {
        let q = config.get("quantization_config")?;
        let list = |key: &str| -> Option<Vec<String>> {
            q.get(key)?.as_array().map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
        };
        Some(Self {
            method: q
                .get("quant_method")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            ignored: list("ignored_layers")
                .or_else(|| list("modules_to_not_convert"))
                .unwrap_or_default(),
        })
    }

    /// Whether this is the native block-FP8 method the engine can run.
    pub fn is_native_fp8(&self) -> bool {
        self.method == "fp8"
    }

    /// Whether `module` (e.g. `model.layers.0.self_attn.q_proj`) stays unquantized: exact
    /// match of the names with any leading `model.` removed from both sides.
    pub fn is_ignored(&self, module: &str) -> bool {
        let m = strip_model_prefix(module);
        self.ignored.iter().any(|i| strip_model_prefix(i) == m)
    }
}

/// Which modules a PEFT LoRA adapter (`adapter_config.json`) attaches to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraTargets {
    /// `target_modules` entries (module-name suffixes), or
    targets: Vec<String>,
    /// a full-match regular expression when `target_modules` is a string (only `.*` and
    /// literal alternatives `(a|b)` are understood).
    pattern: Option<String>,
}

impl LoraTargets {
    /// Reads `target_modules` from a parsed `adapter_config.json`.
    pub fn from_adapter_config(config: &Value) -> Option<Self> {
        match config.get("target_modules")? {
            Value::Array(a) => Some(Self {
                targets: a
                    .iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect(),
                pattern: None,
            }),
            Value::String(s) => Some(Self {
                targets: Vec::new(),
                pattern: Some(s.clone()),
            }),
            _ => None,
        }
    }

    /// Targets given as a list of module-name suffixes.
    pub fn list(targets: &[&str]) -> Self {
        Self {
            targets: targets.iter().map(|s| s.to_string()).collect(),
            pattern: None,
        }
    }

    /// Whether the adapter touches `module` (PEFT's rule: the name equals a target or ends
    /// with `.target`).
    pub fn touches(&self, module: &str) -> bool {
        if let Some(p) = &self.pattern {
            return simple_full_match(p, module);
        }
        self.targets
            .iter()
            .any(|t| module == t || module.ends_with(&format!(".{t}")))
    }
}

/// Full match for the patterns adapters use in practice: `.*` wildcards and `(a|b|c)` groups.
fn simple_full_match(pattern: &str, text: &str) -> bool {
    if let Some(open) = pattern.find('(') {
        if let Some(close_rel) = pattern[open..].find(')') {
            let close = open + close_rel;
            return pattern[open + 1..close].split('|').any(|alt| {
                let p = format!("{}{}{}", &pattern[..open], alt, &pattern[close + 1..]);
                simple_full_match(&p, text)
            });
        }
    }
    let parts: Vec<&str> = pattern.split(".*").collect();
    let literal = |s: &str| s.replace("\\.", ".");
    let mut rest = text;
    for (i, part) in parts.iter().enumerate() {
        let part = literal(part);
        if i == 0 {
            let Some(r) = rest.strip_prefix(part.as_str()) else {
                return false;
            };
            rest = r;
        } else if i == parts.len() - 1 {
            return rest.ends_with(part.as_str());
        } else {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
    }
    rest.is_empty()
}

/// The decision for one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupDecision {
    /// Fuse the group.
    pub fused: bool,
    /// Why, for the load-time log line.
    pub reason: String,
}

/// The decision for one KDA layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionDecision {
    /// `[q|k|v|b|f_a|g_a]`.
    pub input: GroupDecision,
    /// `[f_b|g_b]`.
    pub fg_b: GroupDecision,
}

fn decide_group(
    prefix: &str,
    group: &[&str],
    quant: Option<&QuantizationConfig>,
    lora: Option<&LoraTargets>,
    dtype_of: &dyn Fn(&str) -> Option<String>,
) -> GroupDecision {
    let modules: Vec<String> = group.iter().map(|n| format!("{prefix}.{n}")).collect();
    let no = |reason: String| GroupDecision {
        fused: false,
        reason,
    };
    if let Some(l) = lora {
        if let Some(m) = modules.iter().find(|m| l.touches(m)) {
            return no(format!("LoRA targets {m}"));
        }
    }
    if let Some(q) = quant {
        if !q.is_native_fp8() {
            return no(format!(
                "quantization method {:?} keeps the original projections",
                q.method
            ));
        }
        if let Some(m) = modules.iter().find(|m| !q.is_ignored(m)) {
            return no(format!("{m} is quantized"));
        }
    }
    let dtypes: Vec<Option<String>> = modules
        .iter()
        .map(|m| dtype_of(&format!("{m}.weight")))
        .collect();
    if let Some((m, _)) = modules.iter().zip(&dtypes).find(|(_, d)| d.is_none()) {
        return no(format!("{m}.weight is missing"));
    }
    let first = dtypes[0].clone().unwrap_or_default();
    if !matches!(first.as_str(), "BF16" | "F16" | "F32") {
        return no(format!("dtype {first} is not an unquantized float"));
    }
    if let Some((m, d)) = modules
        .iter()
        .zip(&dtypes)
        .find(|(_, d)| d.as_deref() != Some(first.as_str()))
    {
        return no(format!(
            "{m} is {} while the group is {first}",
            d.clone().unwrap_or_default()
        ));
    }
    GroupDecision {
        fused: true,
        reason: format!("all {} projections unquantized {first}", group.len()),
    }
}

/// Decides fusion for the KDA layer whose attention module is `prefix`
/// (`model.layers.N.self_attn`). `dtype_of` gives a tensor's stored dtype name
/// (`BF16`, `F8_E4M3`, …) or `None` when absent.
pub fn decide(
    prefix: &str,
    quant: Option<&QuantizationConfig>,
    lora: Option<&LoraTargets>,
    dtype_of: &dyn Fn(&str) -> Option<String>,
) -> FusionDecision {
    FusionDecision {
        input: decide_group(prefix, &INPUT_GROUP, quant, lora, dtype_of),
        fg_b: decide_group(prefix, &FG_B_GROUP, quant, lora, dtype_of),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const P: &str = "model.layers.0.self_attn";

    fn all_kda(prefix_model: bool) -> Vec<String> {
        INPUT_GROUP
            .iter()
            .chain(FG_B_GROUP.iter())
            .map(|n| {
                if prefix_model {
                    format!("{P}.{n}")
                } else {
                    format!("layers.0.self_attn.{n}")
                }
            })
            .collect()
    }

    fn bf16(_: &str) -> Option<String> {
        Some("BF16".into())
    }

    fn fp8_except(name: &'static str) -> impl Fn(&str) -> Option<String> {
        move |t: &str| Some(if t.contains(name) { "F8_E4M3" } else { "BF16" }.to_string())
    }

    /// The eligibility table of the issue, one row per case: (fused input, fused f_b/g_b).
    #[test]
    fn eligibility_table() {
        let fp8_ignoring = |names: Vec<String>| QuantizationConfig {
            method: "fp8".into(),
            ignored: names,
        };
        // 1. Plain BF16 checkpoint, no quantization config.
        let d = decide(P, None, None, &bf16);
        assert_eq!((d.input.fused, d.fg_b.fused), (true, true));
        // 2. FP8 checkpoint listing every KDA projection as ignored (with and without `model.`).
        for with_prefix in [true, false] {
            let q = fp8_ignoring(all_kda(with_prefix));
            let d = decide(P, Some(&q), None, &bf16);
            assert_eq!(
                (d.input.fused, d.fg_b.fused),
                (true, true),
                "prefix {with_prefix}"
            );
        }
        // 3. FP8 with one projection quantized (g_a not ignored): input group falls back.
        let mut names = all_kda(true);
        names.retain(|n| !n.ends_with("g_a_proj"));
        let d = decide(P, Some(&fp8_ignoring(names)), None, &fp8_except("g_a_proj"));
        assert_eq!((d.input.fused, d.fg_b.fused), (false, true));
        assert!(
            d.input.reason.contains("g_a_proj is quantized"),
            "{}",
            d.input.reason
        );
        // 4. Another quantization method keeps the original projections.
        let q = QuantizationConfig {
            method: "awq".into(),
            ignored: all_kda(true),
        };
        let d = decide(P, Some(&q), None, &bf16);
        assert_eq!((d.input.fused, d.fg_b.fused), (false, false));
        // 5. LoRA on f_b: only the paired matmul falls back.
        let d = decide(P, None, Some(&LoraTargets::list(&["f_b_proj"])), &bf16);
        assert_eq!((d.input.fused, d.fg_b.fused), (true, false));
        // 6. LoRA elsewhere (o_proj, MLA): both fused.
        let d = decide(
            P,
            None,
            Some(&LoraTargets::list(&["o_proj", "kv_b_proj"])),
            &bf16,
        );
        assert_eq!((d.input.fused, d.fg_b.fused), (true, true));
    }

    #[test]
    fn matching_is_exact_not_substring() {
        let q = QuantizationConfig {
            method: "fp8".into(),
            ignored: vec!["layers.0.self_attn.q_proj".into()],
        };
        assert!(q.is_ignored("model.layers.0.self_attn.q_proj"));
        assert!(
            !q.is_ignored("model.layers.10.self_attn.q_proj"),
            "layers.1 prefix of layers.10"
        );
        assert!(!q.is_ignored("model.layers.0.self_attn.q_proj_extra"));
        let q = QuantizationConfig {
            method: "fp8".into(),
            ignored: vec!["q_proj".into()],
        };
        assert!(
            !q.is_ignored("model.layers.0.self_attn.q_proj"),
            "a bare suffix is not an exact name"
        );
    }

    #[test]
    fn mixed_dtypes_fall_back_without_error() {
        let dtype = |t: &str| {
            Some(
                if t.contains("g_b_proj") {
                    "F16"
                } else {
                    "BF16"
                }
                .to_string(),
            )
        };
        let d = decide(P, None, None, &dtype);
        assert!(d.input.fused);
        assert!(!d.fg_b.fused);
        assert!(d.fg_b.reason.contains("g_b_proj"));
    }

    #[test]
    fn configs_parse() {
        let cfg = json!({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}});
        let q = QuantizationConfig::from_config(&cfg).expect("present");
        assert_eq!(q.ignored, vec!["lm_head".to_string()]);
        assert!(QuantizationConfig::from_config(&json!({})).is_none());
        let l = LoraTargets::from_adapter_config(&json!({"target_modules": ["f_b_proj"]}))
            .expect("list");
        assert!(l.touches("model.layers.3.self_attn.f_b_proj"));
        assert!(!l.touches("model.layers.3.self_attn.g_b_proj"));
        let r = LoraTargets::from_adapter_config(
            &json!({"target_modules": ".*self_attn\\.(f_b_proj|q_proj)"}),
        )
        .expect("regex");
        assert!(r.touches("model.layers.3.self_attn.f_b_proj"));
        assert!(r.touches("model.layers.3.self_attn.q_proj"));
        assert!(!r.touches("model.layers.3.self_attn.k_proj"));
    }
}
