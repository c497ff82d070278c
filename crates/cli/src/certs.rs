//! `tandem tls generate`: a throwaway CA and a certificate per component, for a local or test
//! cluster (`tandem run --tls` uses it). Each certificate names its component's role as a URI
//! SAN (`spiffe://tandem/ROLE`, what workers check callers against), is valid for the given
//! host names and addresses, and may serve as both a server and a client certificate.
//! Production clusters take their certificates from their own CA (cert-manager, Vault).

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::path::{Path, PathBuf};
use tandem_core::identity::{PeerRole, TRUST_DOMAIN};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Directory the PEM files go to (`ca.crt`, `ca.key`, `NAME.crt`, `NAME.key`; created).
    #[arg(long)]
    out: PathBuf,
    /// Sign with the CA whose `ca.crt` and `ca.key` are in this directory instead of a new
    /// one (to add or rotate a component's certificate).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Host names and IP addresses the certificates are valid for.
    #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1")]
    hosts: Vec<String>,
    /// The components: `NAME=ROLE`, or a NAME that says its role (`router`, `admin`,
    /// `prefill-0`, `decode-1`, `worker-0`: a trailing `-N` is dropped).
    #[arg(required = true)]
    components: Vec<String>,
}

/// `NAME=ROLE`, or a name whose role it names.
pub fn parse_component(text: &str) -> Result<(String, PeerRole)> {
    let (name, role) = match text.split_once('=') {
        Some((name, role)) => (name, role),
        None => (
            text,
            text.rsplit_once('-')
                .filter(|(_, n)| n.chars().all(|c| c.is_ascii_digit()))
                .map_or(text, |(role, _)| role),
        ),
    };
    let Some(role) = PeerRole::parse(role) else {
        let roles: Vec<&str> = PeerRole::ALL.iter().map(|r| r.as_str()).collect();
        bail!("`{text}`: no role `{role}` (roles: {})", roles.join(", "));
    };
    if name.is_empty() || name == "ca" || name.contains(['/', '\\']) {
        bail!("`{text}`: `{name}` cannot name a certificate file");
    }
    Ok((name.to_string(), role))
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let components = args
        .components
        .iter()
        .map(|c| parse_component(c))
        .collect::<Result<Vec<_>>>()?;
    generate(&args.out, args.ca.as_deref(), &args.hosts, &components)?;
    println!("{}", args.out.display());
    Ok(())
}

fn write(path: &Path, text: &str, private: bool) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes a CA (unless `ca_dir` holds one to sign with) and a certificate and key per
/// component into `out`.
pub fn generate(
    out: &Path,
    ca_dir: Option<&Path>,
    hosts: &[String],
    components: &[(String, PeerRole)],
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let issuer = match ca_dir {
        Some(dir) => {
            let read = |name: &str| {
                let path = dir.join(name);
                std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))
            };
            let key = KeyPair::from_pem(&read("ca.key")?).context("ca.key")?;
            let ca_pem = read("ca.crt")?;
            if dir != out {
                write(&out.join("ca.crt"), &ca_pem, false)?;
            }
            Issuer::from_ca_cert_pem(&ca_pem, key).context("ca.crt")?
        }
        None => {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params
                .distinguished_name
                .push(DnType::CommonName, "tandem throwaway CA");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let cert = params.self_signed(&key)?;
            write(&out.join("ca.crt"), &cert.pem(), false)?;
            write(&out.join("ca.key"), &key.serialize_pem(), true)?;
            Issuer::new(params, key)
        }
    };
    for (name, role) in components {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(hosts.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, name.as_str());
        params.subject_alt_names.push(SanType::URI(
            role.spiffe_uri(TRUST_DOMAIN)
                .try_into()
                .context("a role URI is ASCII")?,
        ));
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &issuer)?;
        write(&out.join(format!("{name}.crt")), &cert.pem(), false)?;
        write(&out.join(format!("{name}.key")), &key.serialize_pem(), true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;

    #[test]
    fn components_name_their_roles() {
        let ok = |t: &str| parse_component(t).expect(t);
        assert_eq!(ok("router"), ("router".into(), PeerRole::Router));
        assert_eq!(ok("prefill-0"), ("prefill-0".into(), PeerRole::Prefill));
        assert_eq!(ok("decode-12"), ("decode-12".into(), PeerRole::Decode));
        assert_eq!(ok("ops=admin"), ("ops".into(), PeerRole::Admin));
        for bad in ["rooter", "prefill-x", "ca=admin", "../x=router", "=router"] {
            assert!(parse_component(bad).is_err(), "{bad}");
        }
    }
}
