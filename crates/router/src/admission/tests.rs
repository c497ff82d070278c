//! Tests of admission: rate limits on an injected clock, the priority queue polled by hand.

use super::*;
use crate::config::KeyAdmission;
use futures::poll;
use std::task::Poll;

fn admission(config: AdmissionConfig) -> Arc<Admission> {
    Arc::new(Admission::new(config, &Registry::new()))
}

fn queued(max_running: usize, capacity: usize) -> Arc<Admission> {
    admission(AdmissionConfig {
        max_running: Some(max_running),
        queue_capacity: capacity,
        queue_timeout: Duration::from_secs(3600),
        ..AdmissionConfig::default()
    })
}

fn caller(name: &str) -> Caller {
    Caller(name.into())
}

fn rejections(a: &Admission, reason: Rejection) -> u64 {
    a.metrics
        .rejections
        .with_label_values(&[reason.as_str()])
        .get()
}

#[tokio::test]
async fn the_defaults_admit_everything_at_once() {
    let a = admission(AdmissionConfig::default());
    let k = caller("k");
    let tickets: Vec<Ticket> =
        futures::future::try_join_all((0..10_000).map(|_| a.admit(Some(&k), 0, 100_000)))
            .await
            .expect("nothing is limited");
    assert_eq!(tickets.len(), 10_000);
    assert_eq!(a.queue_depth(), 0);
}

#[test]
fn a_key_over_its_rate_is_refused_with_the_wait_while_another_key_passes() {
    let limited = RateLimits {
        requests_per_second: Some(2.0),
        ..RateLimits::default()
    };
    let a = admission(AdmissionConfig {
        keys: [(
            "batch".to_owned(),
            KeyAdmission {
                limits: limited,
                priority: Some(10),
            },
        )]
        .into(),
        ..AdmissionConfig::default()
    });
    let t0 = Instant::now();
    let batch = caller("batch");
    for _ in 0..2 {
        a.check_rates(Some(&batch), 1.0, t0)
            .expect("within the burst");
    }
    let e = a
        .check_rates(Some(&batch), 1.0, t0)
        .expect_err("third at once");
    assert_eq!(e.status().as_u16(), 429);
    assert!(
        e.message().contains("this API key's requests"),
        "{}",
        e.message()
    );
    assert_eq!(rejections(&a, Rejection::KeyRequests), 1);
    // Another key has no limit of its own (per_key is unset), nor has the router.
    for _ in 0..100 {
        a.check_rates(Some(&caller("interactive")), 1.0, t0)
            .expect("unlimited");
    }
    // Half a second later the limited key has one request again.
    a.check_rates(Some(&batch), 1.0, t0 + Duration::from_millis(500))
        .expect("refilled");
    assert_eq!(a.priority(Some(&batch), None), 10);
    assert_eq!(
        a.priority(Some(&batch), Some(-1)),
        -1,
        "the request's own wins"
    );
    assert_eq!(a.priority(Some(&caller("interactive")), None), 0);
}

#[test]
fn a_refused_request_takes_nothing_from_the_buckets_it_passed() {
    let a = admission(AdmissionConfig {
        global: RateLimits {
            tokens_per_second: Some(1000.0),
            ..RateLimits::default()
        },
        per_key: RateLimits {
            requests_per_second: Some(1.0),
            ..RateLimits::default()
        },
        ..AdmissionConfig::default()
    });
    let t0 = Instant::now();
    a.check_rates(Some(&caller("a")), 600.0, t0).expect("first");
    // `a` is out of requests; its 400 tokens must stay in the global bucket for `b`.
    let e = a
        .check_rates(Some(&caller("a")), 400.0, t0)
        .expect_err("a's second request at once");
    assert!(e.message().contains("API key"), "{}", e.message());
    a.check_rates(Some(&caller("b")), 400.0, t0)
        .expect("the global bucket kept its 400 tokens");
    let e = a
        .check_rates(Some(&caller("c")), 100.0, t0)
        .expect_err("the global tokens are spent");
    assert!(e.message().contains("admission.global"), "{}", e.message());
    assert_eq!(rejections(&a, Rejection::GlobalTokens), 1);
    assert_eq!(rejections(&a, Rejection::KeyRequests), 1);
}

#[tokio::test]
async fn a_higher_priority_request_queued_later_is_admitted_first() {
    let a = queued(1, 8);
    let running = a.admit(None, 0, 1).await.expect("a free place");
    let mut batch_1 = Box::pin(a.admit(None, 5, 1));
    let mut batch_2 = Box::pin(a.admit(None, 5, 1));
    let mut interactive = Box::pin(a.admit(None, 0, 1));
    assert!(poll!(&mut batch_1).is_pending());
    assert!(poll!(&mut batch_2).is_pending());
    assert!(poll!(&mut interactive).is_pending());
    assert_eq!(a.queue_depth(), 3);
    drop(running);
    assert!(poll!(&mut batch_1).is_pending());
    let Poll::Ready(Ok(first)) = poll!(&mut interactive) else {
        panic!("the interactive request did not get the freed place");
    };
    assert!(poll!(&mut batch_2).is_pending());
    drop(first);
    assert!(
        poll!(&mut batch_2).is_pending(),
        "arrival order within a priority"
    );
    let Poll::Ready(Ok(second)) = poll!(&mut batch_1) else {
        panic!("the first batch request did not get the next place");
    };
    drop(second);
    let Poll::Ready(Ok(_third)) = poll!(&mut batch_2) else {
        panic!("the last batch request did not get the last place");
    };
    assert_eq!(a.queue_depth(), 0);
    assert_eq!(a.metrics.queue_wait.get_sample_count(), 4);
}

#[tokio::test]
async fn a_full_queue_answers_429_and_a_waiter_that_leaves_frees_its_place() {
    let a = queued(1, 1);
    let running = a.admit(None, 0, 1).await.expect("a free place");
    let mut waiting = Box::pin(a.admit(None, 0, 1));
    assert!(poll!(&mut waiting).is_pending());
    let e = a.admit(None, -100, 1).await.expect_err("no room to wait");
    assert_eq!(e.status().as_u16(), 429);
    assert!(
        e.message().contains("admission.queue_capacity"),
        "{}",
        e.message()
    );
    assert_eq!(rejections(&a, Rejection::QueueFull), 1);
    // The client goes away while queued: its place in the queue is given up.
    drop(waiting);
    assert_eq!(a.queue_depth(), 0);
    let mut next = Box::pin(a.admit(None, 0, 1));
    assert!(poll!(&mut next).is_pending());
    drop(running);
    assert!(matches!(poll!(&mut next), Poll::Ready(Ok(_))));
}

#[tokio::test]
async fn a_place_handed_to_a_waiter_that_left_goes_to_the_next() {
    let a = queued(1, 8);
    let running = a.admit(None, 0, 1).await.expect("a free place");
    let mut gone = Box::pin(a.admit(None, 0, 1));
    let mut next = Box::pin(a.admit(None, 1, 1));
    assert!(poll!(&mut gone).is_pending());
    assert!(poll!(&mut next).is_pending());
    // The place is sent to `gone`, which is dropped before it looks.
    drop(running);
    drop(gone);
    assert!(matches!(poll!(&mut next), Poll::Ready(Ok(_))));
}

#[tokio::test(start_paused = true)]
async fn a_wait_past_the_queue_timeout_answers_503_saying_so() {
    let a = admission(AdmissionConfig {
        max_running: Some(1),
        queue_timeout: Duration::from_secs(5),
        ..AdmissionConfig::default()
    });
    let running = a.admit(None, 0, 1).await.expect("a free place");
    let e = a
        .admit(None, 0, 1)
        .await
        .expect_err("the place never frees");
    assert_eq!(e.status().as_u16(), 503);
    assert!(
        e.message().contains("queue wait expired"),
        "{}",
        e.message()
    );
    assert_eq!(rejections(&a, Rejection::QueueTimeout), 1);
    assert_eq!(a.queue_depth(), 0);
    drop(running);
    let _again = a.admit(None, 0, 1).await.expect("the place came back");
}
