//! Kill faults: `tandem chaos replay` sends SIGKILL to named processes at an interval during
//! its run. Processes are named on its command line with the file holding each one's pid
//! (`--process decode=/run/tandem/decode.pid`), read afresh before every kill, so a
//! supervisor that restarts a worker and rewrites its pid file (`tandem run` does) has the
//! new process killed next time. A target whose file is missing, or whose process is not
//! running, is skipped for that turn and counted as such.

use crate::scenario::KillFaults;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A process the replay may kill, as named on its command line: `NAME=PIDFILE`.
pub fn parse_process(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => {
            Ok((name.to_string(), PathBuf::from(file)))
        }
        _ => Err(format!("`{text}`: expected NAME=PIDFILE")),
    }
}

/// Checks that every kill target is a named process.
pub fn check_targets(
    kill: &KillFaults,
    processes: &BTreeMap<String, PathBuf>,
) -> Result<(), String> {
    let missing: Vec<&str> = kill
        .targets
        .iter()
        .filter(|t| !processes.contains_key(*t))
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the scenario kills {} but no --process NAME=PIDFILE names {}",
            missing.join(", "),
            if missing.len() == 1 { "it" } else { "them" }
        ))
    }
}

/// What the killer did.
#[derive(Debug, Default)]
pub struct KillCounts {
    /// Processes killed.
    pub killed: AtomicU64,
    /// Turns skipped: no pid file, or its process was not running.
    pub skipped: AtomicU64,
}

/// The pid in `file`, if it names a running process.
fn running_pid(file: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
    // A zombie (a killed child its parent has not reaped yet) is not running.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit_once(')')?.1.split_whitespace().next()?;
    (state != "Z" && state != "X").then_some(pid)
}

/// Kills the scenario's targets in turn, `every` apart, until the limit or until dropped
/// (the replay aborts it when its run ends). Counts go to `counts`.
pub async fn run(kill: KillFaults, processes: BTreeMap<String, PathBuf>, counts: Arc<KillCounts>) {
    if kill.targets.is_empty() || kill.every.is_zero() {
        return;
    }
    let mut turns = 0u64;
    for name in kill.targets.iter().cycle() {
        if kill
            .limit
            .is_some_and(|l| counts.killed.load(Ordering::Relaxed) >= l)
        {
            return;
        }
        tokio::time::sleep(kill.every).await;
        turns += 1;
        let Some(file) = processes.get(name) else {
            continue;
        };
        let killed = match running_pid(file) {
            Some(pid) => std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status()
                .is_ok_and(|s| s.success())
                .then_some(pid),
            None => None,
        };
        match killed {
            Some(pid) => {
                counts.killed.fetch_add(1, Ordering::Relaxed);
                eprintln!("kill {turns}: sent SIGKILL to {name} (pid {pid})");
            }
            None => {
                counts.skipped.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "kill {turns}: {name} is not running ({}); skipped",
                    file.display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::time::Duration;

    #[test]
    fn processes_are_name_equals_pidfile_and_every_target_must_be_named() {
        assert_eq!(
            parse_process("decode=/tmp/d.pid").unwrap(),
            ("decode".to_string(), PathBuf::from("/tmp/d.pid"))
        );
        for bad in ["decode", "=x", "decode="] {
            assert!(parse_process(bad).is_err(), "{bad}");
        }
        let kill = KillFaults {
            targets: vec!["decode".into(), "prefill".into()],
            every: Duration::from_secs(1),
            limit: None,
        };
        let named: BTreeMap<_, _> = [("decode".to_string(), PathBuf::from("d.pid"))].into();
        let e = check_targets(&kill, &named).unwrap_err();
        assert!(e.contains("kills prefill") && e.contains("names it"), "{e}");
    }

    /// A real child process: killed once (the limit), its zombie not taken for a live one.
    #[tokio::test]
    async fn a_named_process_is_killed_up_to_the_limit_and_a_dead_one_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let file = dir.path().join("sleep.pid");
        std::fs::write(&file, child.id().to_string()).unwrap();
        let missing = dir.path().join("none.pid");
        let processes: BTreeMap<_, _> = [
            ("sleeper".to_string(), file.clone()),
            ("ghost".to_string(), missing),
        ]
        .into();
        let counts = Arc::new(KillCounts::default());
        let kill = KillFaults {
            targets: vec!["ghost".into(), "sleeper".into()],
            every: Duration::from_millis(10),
            limit: Some(1),
        };
        tokio::time::timeout(
            Duration::from_secs(30),
            run(kill, processes.clone(), counts.clone()),
        )
        .await
        .expect("the killer stops at its limit");
        assert_eq!(counts.killed.load(Ordering::Relaxed), 1);
        assert!(
            counts.skipped.load(Ordering::Relaxed) >= 1,
            "the ghost was skipped"
        );
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9), "{status:?}");
        assert_eq!(running_pid(&file), None, "a reaped process is not running");
    }
}
