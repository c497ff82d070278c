fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = ["tandem/v1/worker.proto", "tandem/v1/kv.proto"].map(|f| root.join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    tonic_prost_build::configure()
        .compile_protos(&files, &[root])
        .expect("protoc must be installed (apt-get install protobuf-compiler libprotobuf-dev)");
}
