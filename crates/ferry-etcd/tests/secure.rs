//! Fail closed: against an etcd that serves TLS, a plaintext URL and an untrusted certificate get an
//! error and only the right CA works; against an etcd with authentication on, an anonymous engine and
//! a wrong password are refused and the right user publishes.

mod etcd;

use std::time::Duration;

use etcd::Etcd;
use ferry::Engine;
use ferry_etcd::{EtcdDirectory, EtcdOptions, EtcdTls};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

fn options() -> EtcdOptions {
    EtcdOptions {
        ttl: Duration::from_secs(3),
        timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

/// Publishes an engine named `name` through a directory made with `options` at `url`.
async fn publish(url: &str, name: &str, options: EtcdOptions) -> ferry::Result<Engine> {
    etcd::publish(url, "/secure", name, options).await
}

/// A CA, and a certificate for 127.0.0.1 it signed: (CA PEM, certificate PEM, key PEM).
fn certificates() -> (String, String, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, "etcd test CA");
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "etcd");
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_etcd_never_falls_back_and_trusts_only_its_ca() {
    let (ca, cert, key) = certificates();
    let dir = std::env::temp_dir().join(format!("ferry-etcd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_file, key_file) = (dir.join("etcd.pem"), dir.join("etcd.key"));
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let Some(etcd) = Etcd::start_with(Some((cert_file, key_file))) else {
        return;
    };
    let url = etcd.url();
    assert!(url.starts_with("etcds://"));

    // Plaintext to a TLS etcd: an error, not a session.
    let plain = url.replacen("etcds://", "etcd://", 1);
    assert!(
        publish(&plain, "plain", options()).await.is_err(),
        "plaintext reached a TLS etcd"
    );
    // TLS with the system's roots only: etcd's certificate is not trusted.
    assert!(
        publish(&url, "untrusted", options()).await.is_err(),
        "an untrusted certificate was accepted"
    );
    // TLS options on a plaintext URL are refused before anything is sent.
    let with_ca = EtcdOptions {
        tls: Some(EtcdTls {
            ca_pem: ca.into_bytes(),
            client: None,
        }),
        ..options()
    };
    let refused = EtcdDirectory::connect(&plain, "/secure", with_ca.clone())
        .await
        .unwrap_err();
    assert!(matches!(refused, ferry::Error::InvalidArgument(_)), "{refused}");
    // The right CA: published and listed.
    let engine = publish(&url, "secure-0", with_ca).await.unwrap();
    assert_eq!(etcd::member_names(&engine).await.unwrap(), ["secure-0"]);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_with_authentication_refuses_anonymous_and_wrong_passwords() {
    let Some(etcd) = Etcd::start() else { return };
    let mut admin = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    admin.user_add("root", "right", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let anonymous = publish(&etcd.url(), "anonymous", options()).await.unwrap_err();
    assert!(matches!(anonymous, ferry::Error::PermissionDenied(_)), "{anonymous}");
    let wrong = EtcdOptions {
        user: Some(("root".into(), "wrong".into())),
        ..options()
    };
    let wrong = publish(&etcd.url(), "wrong", wrong).await.unwrap_err();
    assert!(matches!(wrong, ferry::Error::PermissionDenied(_)), "{wrong}");
    let right = EtcdOptions {
        user: Some(("root".into(), "right".into())),
        ..options()
    };
    let engine = publish(&etcd.url(), "root-0", right).await.unwrap();
    assert_eq!(
        etcd::member_names(&engine).await.unwrap(),
        ["root-0"],
        "only the authenticated engine is published"
    );
}
