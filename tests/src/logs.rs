//! The processes' logs: each process's stderr teed into its log file by a thread (which also
//! reports the process's ready line and its end), and the [`Cluster`] methods that read and
//! wait on them.

use super::{Cluster, StartEvent};
use std::sync::mpsc;
use std::time::{Duration, Instant};

impl Cluster {
    /// The last lines of every process's log, for failure messages.
    pub(crate) fn logs(&self) -> String {
        let mut out = String::new();
        for (name, _) in &self.children {
            let text = std::fs::read_to_string(self._dir.path().join(format!("{name}.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            out.push_str(&format!("--- {name} log (last lines) ---\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Whether the log of process `name` holds `needle` within `limit` ([`Cluster::wait_log_for`]).
    pub fn wait_log(&self, name: &str, needle: &str, limit: Duration) -> bool {
        self.wait_log_for(name, limit, |log| log.contains(needle))
    }

    /// Whether the log of process `name` satisfies `found` within `limit`: its lines reach the
    /// log file through a tee thread, so a line the process wrote before answering a request
    /// may not be in the file yet when the answer arrives. Woken by each line written.
    pub fn wait_log_for(&self, name: &str, limit: Duration, found: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        let (count, wrote) = &*self.written;
        let mut seen = count.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // Checked under the lock a tee takes after writing: a line written after this
            // look wakes the wait below.
            if found(&self.log(name)) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            seen = wrote
                .wait_timeout(seen, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The whole log of the process started as `name`.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self._dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Prints the processes' logs (for failing tests).
    pub fn dump_logs(&self) {
        eprintln!("{}", self.logs());
    }
}

/// The `127.0.0.1:PORT` after `listen=` in a ready line (empty if absent).
fn listen_addr(line: &str) -> String {
    line.split("listen")
        .nth(1)
        .and_then(|rest| rest.find("127.0.0.1:").map(|at| &rest[at..]))
        .map(|addr| {
            let end = "127.0.0.1:".len()
                + addr["127.0.0.1:".len()..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(addr.len() - "127.0.0.1:".len());
            addr[..end].to_string()
        })
        .unwrap_or_default()
}

/// A count of log lines written, and the condition waiters on it wait for.
pub(crate) type LinesWritten = std::sync::Arc<(std::sync::Mutex<u64>, std::sync::Condvar)>;

/// Copies a process's stderr into its log file, reporting its ready line and its end.
pub(crate) fn tee_log(
    stderr: std::process::ChildStderr,
    mut log: std::fs::File,
    name: &str,
    tx: &mpsc::Sender<StartEvent>,
    written: &LinesWritten,
) {
    use std::io::{BufRead, Write};
    let mut announced = false;
    for line in std::io::BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
    {
        let _ = writeln!(log, "{line}");
        {
            let (count, wrote) = &**written;
            *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            wrote.notify_all();
        }
        if !announced
            && (line.contains("worker ready")
                || line.contains("router ready")
                || line.contains("proxy ready"))
        {
            announced = true;
            let admin = line
                .split("admin=Some(")
                .nth(1)
                .and_then(|r| r.split(')').next())
                .unwrap_or_default()
                .to_string();
            let _ = tx.send(StartEvent::Ready(
                name.to_string(),
                listen_addr(&line),
                admin,
            ));
        }
    }
    let _ = tx.send(StartEvent::Exited(name.to_string()));
}
