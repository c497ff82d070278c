//! Every file under the repository's `configs/` parses and validates as a router configuration.

use std::path::Path;
use tandem_router::RouterConfig;

#[test]
fn every_shipped_config_is_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/ exists") {
        let path = entry.expect("readable entry").path();
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            continue;
        }
        let config =
            RouterConfig::load(&path).unwrap_or_else(|err| panic!("{}: {err:#?}", path.display()));
        assert!(!config.prefill.is_empty() && !config.decode.is_empty());
        checked += 1;
    }
    assert!(checked > 0, "no YAML files in {}", dir.display());
}

#[test]
fn local_cpu_matches_make_run() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/local-cpu.yaml");
    let config = RouterConfig::load(&path).expect("valid");
    assert_eq!(config.listen.to_string(), "127.0.0.1:8000");
    assert_eq!(
        config.prefill[0].address.to_string(),
        "http://127.0.0.1:50061"
    );
    assert_eq!(
        config.decode[0].address.to_string(),
        "http://127.0.0.1:50062"
    );
    assert_eq!(
        config.model.dir, None,
        "the model dir comes from the command line"
    );
}
