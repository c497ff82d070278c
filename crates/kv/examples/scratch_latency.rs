use std::time::{Duration, Instant};
use tandem_kv::{UcxReceiver, UcxSender};

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let t0 = Instant::now();
    let mut receiver = UcxReceiver::listen("127.0.0.1:0").expect("listen");
    let mut incoming = receiver.take_incoming().expect("incoming");
    let sender = UcxSender::new().expect("sender");
    println!("setup {:?}", t0.elapsed());
    for tag in 0..8u64 {
        let len = if tag % 2 == 0 { 1 << 20 } else { 16 };
        let t = Instant::now();
        let p = pattern(len, tag);
        let gen = t.elapsed();
        sender.send(&receiver.address(), tag, p, Duration::from_secs(5)).await.expect("send");
        println!("tag {tag} gen {gen:?} send {:?}", t.elapsed());
    }
    for _ in 0..8u64 {
        let t = Instant::now();
        let m = incoming.recv().await.expect("msg");
        println!("recv tag {} {:?}", m.tag, t.elapsed());
    }
    let t = Instant::now();
    drop(sender);
    println!("drop sender {:?}", t.elapsed());
    let t = Instant::now();
    drop(receiver);
    println!("drop receiver {:?}", t.elapsed());
}
