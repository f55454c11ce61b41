//! [`check_header_block`] against async-nats 0.49's own parser, which is private: a server of
//! the test's own (a few lines over a `TcpListener`) sends one `HMSG` with the block to a
//! real async-nats client, and what the client does with it (hands the message over, with
//! or without a status; fails its connection; loses its connection task) must be what the
//! checker says. No NATS server is needed.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::time::Duration;

use futures::StreamExt;
use proptest::prelude::*;
use transport_nats::{ClientFailure, check_header_block};

/// What the client did with the message.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Delivered,
    Failed(ClientFailure),
    /// Nothing within the wait: neither the message nor a failure.
    Nothing,
}

/// Serves one client: the handshake, then, once it has subscribed, the block's `HMSG`.
fn serve_once(listener: TcpListener, block: Vec<u8>) {
    let Ok((socket, _)) = listener.accept() else {
        return;
    };
    drop(listener);
    let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
    let Ok(mut writer) = socket.try_clone() else {
        return;
    };
    let info = "INFO {\"server_id\":\"fake\",\"server_name\":\"fake\",\"version\":\"2.9.10\",\"go\":\"go1\",\"host\":\"127.0.0.1\",\"port\":4222,\"headers\":true,\"max_payload\":1048576,\"proto\":1}\r\n";
    if writer.write_all(info.as_bytes()).is_err() {
        return;
    }
    let mut reader = BufReader::new(socket);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        match words.as_slice() {
            ["PING"] => {
                let _ = writer.write_all(b"PONG\r\n");
            }
            ["SUB", subject, sid] => {
                let mut frame = format!(
                    "HMSG {subject} {sid} {} {}\r\n",
                    block.len(),
                    block.len() + 7
                )
                .into_bytes();
                frame.extend_from_slice(&block);
                frame.extend_from_slice(b"payload\r\n");
                let _ = writer.write_all(&frame);
            }
            _ => {}
        }
    }
}

async fn what_the_client_does(block: Vec<u8>) -> Seen {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let port = listener.local_addr().expect("its address").port();
    // Not joined: it ends once the client's socket closes, or its read times out.
    std::thread::spawn(move || serve_once(listener, block));
    let (lost_tx, mut lost) = tokio::sync::mpsc::unbounded_channel();
    let client = async_nats::ConnectOptions::new()
        .event_callback(move |event| {
            let lost_tx = lost_tx.clone();
            async move {
                if event == async_nats::Event::Disconnected {
                    let _ = lost_tx.send(());
                }
            }
        })
        .connect(format!("127.0.0.1:{port}"))
        .await
        .expect("the fake server takes the client");
    // No flush: one made before a lost connection would wait for the next connection.
    let mut subscriber = client.subscribe("t").await.expect("subscribe");
    let seen = tokio::select! {
        message = subscriber.next() => match message {
            Some(m) if m.status.is_some_and(|s| s != async_nats::StatusCode::OK) => {
                Seen::Failed(ClientFailure::ReadAsStatus)
            }
            Some(m) if m.payload.as_ref() == b"payload" => Seen::Delivered,
            Some(_) => Seen::Nothing,
            // The subscription's sender went with the connection task.
            None => Seen::Failed(ClientFailure::ClientDies),
        },
        // `None` is not a loss: the channel closes when the client's tasks end, as they do
        // when the connection task panics.
        Some(()) = lost.recv() => Seen::Failed(ClientFailure::ConnectionLost),
        () = tokio::time::sleep(Duration::from_secs(10)) => Seen::Nothing,
    };
    seen
}

fn predicted(block: &[u8]) -> Seen {
    match check_header_block(block) {
        Ok(()) => Seen::Delivered,
        Err(e) => Seen::Failed(e.failure()),
    }
}

/// async-nats's assertion on a value with a CR panics its connection task: expected here, so
/// not printed; every other panic is.
fn quiet_expected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            if !text.contains("invalid header value") {
                default(info);
            }
        }));
    });
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

fn check(rt: &tokio::runtime::Runtime, block: &[u8]) -> Result<(), String> {
    let seen = rt.block_on(what_the_client_does(block.to_vec()));
    let said = predicted(block);
    if seen == said {
        Ok(())
    } else {
        Err(format!(
            "block {:?}: async-nats {seen:?}, the checker {said:?} ({:?})",
            String::from_utf8_lossy(block),
            check_header_block(block).err().map(|e| e.to_string())
        ))
    }
}

/// One of `pieces`, each as often as its weight says.
fn weighted(pieces: &[(u32, &[u8])]) -> impl Strategy<Value = Vec<u8>> + use<> {
    let choices: Vec<(u32, Vec<u8>)> = pieces.iter().map(|(w, p)| (*w, p.to_vec())).collect();
    let total: u32 = choices.iter().map(|(w, _)| w).sum();
    (0..total).prop_map(move |mut n| {
        for (w, piece) in &choices {
            if n < *w {
                return piece.clone();
            }
            n -= w;
        }
        Vec::new()
    })
}

/// One line of a block, from pieces that the parser treats differently. Pieces a
/// well-behaved client writes are the likelier, so that most blocks are valid up to one
/// oddity and every rule is reached.
fn line() -> impl Strategy<Value = Vec<u8>> {
    let name = prop::collection::vec(
        weighted(&[
            (8, b"a"),
            (4, b"Nats-Msg-Id"),
            (4, b"x-retry-attempts"),
            (4, b"-"),
            (1, b" "),
            (1, b"\t"),
            (1, b"\x7f"),
            (1, b"\x01"),
            (1, b"\xff"),
            (1, "\u{e9}".as_bytes()),
        ]),
        0..4,
    );
    let value = prop::collection::vec(
        weighted(&[
            (8, b"v"),
            (3, b" "),
            (2, b"\t"),
            (1, b"\r"),
            (2, b":"),
            (1, b"\x01"),
            (1, b"\xfe"),
            (1, b"\xc3"),
            (2, "\u{e9}".as_bytes()),
            (2, "\u{a0}".as_bytes()),
            (2, b"~i:notanumber"),
        ]),
        0..5,
    );
    // A line led by whitespace continues the header before it; Unicode whitespace counts.
    let lead = weighted(&[
        (12, b""),
        (2, b" "),
        (2, b"\t"),
        (2, "\u{a0}".as_bytes()),
        (1, "\u{2028}".as_bytes()),
    ]);
    let colon = weighted(&[(9, b":"), (1, b"")]);
    (lead, name, colon, value).prop_map(|(lead, name, colon, value)| {
        [lead, name.concat(), colon, value.concat()].concat()
    })
}

fn block() -> impl Strategy<Value = Vec<u8>> {
    let first = weighted(&[
        (12, b"NATS/1.0"),
        (2, b"NATS/1.0 "),
        (1, b"NATS/1.0 200"),
        (1, b"NATS/1.0 200 OK"),
        (1, b"NATS/1.0 408 Request Timeout"),
        (1, b"NATS/1.0 100"),
        (1, b"NATS/1.0 503"),
        (1, b"NATS/1.0 99"),
        (1, b"NATS/1.0 abc"),
        (1, b"NATS/1.0 \xff"),
        (1, b"NATS/1.1"),
        (1, b""),
    ]);
    let end = || weighted(&[(6, b"\r\n"), (2, b"\n"), (1, b"\r")]);
    let lines = prop::collection::vec((line(), end()), 0..6);
    let structured =
        (first, end(), lines, any::<bool>()).prop_map(|(first, first_end, lines, closed)| {
            let mut block = [first, first_end].concat();
            for (line, end) in lines {
                block.extend(line);
                block.extend(end);
            }
            if closed {
                block.extend_from_slice(b"\r\n");
            }
            block
        });
    // Bytes with no structure at all, from an alphabet where structure is likely.
    let loose = prop::collection::vec(
        prop::sample::select(b"NATS/1.0 :\r\n\ta\xff\x7f".to_vec()),
        0..40,
    );
    prop_oneof![4 => structured, 1 => loose]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn the_checker_says_what_async_nats_does(block in block()) {
        quiet_expected_panics();
        let rt = runtime();
        let outcome = check(rt, &block);
        prop_assert!(outcome.is_ok(), "{}", outcome.err().unwrap_or_default());
    }
}

/// Each kind of block once, so that a change in async-nats shows up here by name.
#[test]
fn each_kind_of_block_does_what_the_checker_says() {
    quiet_expected_panics();
    let rt = runtime();
    let kinds: [&[u8]; 12] = [
        b"NATS/1.0\r\nNats-Msg-Id: order-1\r\n\r\n",
        b"NATS/1.0\r\ntenant: ac\xffme\r\n\r\n",
        b"NATS/1.0\r\nten\xfeant: acme\r\n\r\n",
        b"NATS/1.0\r\nNats-Msg-Id: bad-\xff\xfe-id\r\n\r\n",
        b"NATS/1.0\r\nno colon here\r\n\r\n",
        b"NATS/1.0\r\nc: a\x01\x07\x1b\x7fb\tc\r\n\r\n",
        b"NATS/1.0\r\nx-retry-attempts: ~i:notanumber\r\n\r\n",
        b"NATS/1.0\r\na: x\ry\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\n\r\n",
        b"NATS/1.0 100 Idle Heartbeat\r\n\r\n",
        b"NATS/1.0 abc\r\n\r\n",
        b"NATS/1.0\r\nnote: one\r\n two\r\n\r\n",
    ];
    let mut mismatches = Vec::new();
    for block in kinds {
        if let Err(e) = check(rt, block) {
            mismatches.push(e);
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    // And the checker does not pass everything: these are the failures it names.
    let failing = kinds
        .iter()
        .filter(|b| check_header_block(b).is_err())
        .count();
    assert_eq!(failing, 8);
}
