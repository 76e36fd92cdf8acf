//! `include/ferry.h` is what cbindgen makes of this crate today. Set `FERRY_BLESS=1` to rewrite it.

use std::path::PathBuf;

#[test]
fn the_committed_header_is_current() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include/ferry.h");
    if std::env::var_os("FERRY_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("writing include/ferry.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/ferry.h is not what cbindgen makes of the code: run `FERRY_BLESS=1 cargo test -p ferry-capi --test header`"
    );
}
