//! Probes the system UCX with pkg-config and generates bindings into `OUT_DIR`.

use std::env;
use std::path::PathBuf;

const INSTALL_HINT: &str = "tandem-ucx-sys needs the system UCX library and its headers. \
     On Debian/Ubuntu install them with `apt-get install libucx-dev libclang-dev pkg-config` \
     (add `ucx-utils` for ucx_info / ucx_perftest).";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");

    let ucx = match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(err) => {
            println!("cargo:warning={INSTALL_HINT}");
            panic!("pkg-config could not find `ucx`: {err}\n{INSTALL_HINT}");
        }
    };
    // The ucx.pc on Debian lists ucp, uct, ucs and ucm; make sure ucs (status strings,
    // config parser) is linked even where a .pc file is thinner.
    if !ucx.libs.iter().any(|l| l == "ucs") {
        println!("cargo:rustc-link-lib=ucs");
    }

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("ucp_.*|ucs_.*")
        .allowlist_type("ucp_.*|ucs_.*")
        .allowlist_var("UCP_.*|UCS_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(false);
    for dir in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }

    // bindgen panics (rather than erroring) when libclang itself cannot be loaded; either way
    // point at the packages to install.
    let generated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.generate()));
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(err)) => {
            println!("cargo:warning={INSTALL_HINT}");
            panic!("bindgen failed on the UCX headers: {err}\n{INSTALL_HINT}");
        }
        Err(_) => {
            println!("cargo:warning={INSTALL_HINT}");
            panic!("bindgen could not run (is libclang installed?)\n{INSTALL_HINT}");
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo always sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("OUT_DIR is writable");
}
