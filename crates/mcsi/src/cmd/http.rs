//! The observation endpoint of long-running commands (`--metrics ADDR:PORT`): `GET /metrics`
//! answers in the Prometheus text format, `GET /state` with a JSON snapshot of the sessions'
//! connections and their TCP state (what `mcsi monitor` reads). Nothing else is served.

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use std::net::SocketAddr;
use std::sync::Arc;

/// What the endpoint shows.
pub trait Source: Send + Sync + 'static {
    /// The Prometheus exposition text.
    fn metrics(&self) -> String;
    /// The JSON snapshot.
    fn state(&self) -> serde_json::Value;
}

/// Connections the endpoint serves at once; more are closed as soon as they are accepted, so
/// that slow or idle clients cannot use up the process's file descriptors.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its request's headers.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Time one connection may last, request and answer (one request per connection).
pub const CONNECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Binds `addr` and serves until the runtime ends. Returns the bound address. The endpoint
/// takes one request per connection, at most [`MAX_CONNECTIONS`] at once, each within
/// [`CONNECTION_TIMEOUT`]. An address other than loopback is served with a warning: `/state`
/// names the initiators and their ISIDs.
pub async fn serve(addr: &str, source: Arc<dyn Source>) -> anyhow::Result<SocketAddr> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--metrics {addr}: expected IP:PORT, e.g. 127.0.0.1:9464"))?;
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics: cannot listen on {addr}"))?;
    let local = l.local_addr()?;
    if !local.ip().is_loopback() {
        tracing::warn!(
            "--metrics {local}: reachable from the network without authentication; /state names the initiators and their ISIDs (bind 127.0.0.1 unless a firewall limits access)"
        );
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = l.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "metrics endpoint: {MAX_CONNECTIONS} connections already; closing");
                drop(stream);
                continue;
            };
            let source = source.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let source = source.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(&*source, &req)) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(io, svc);
                let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
                drop(slot);
            });
        }
    });
    Ok(local)
}

fn answer<B>(source: &dyn Source, req: &Request<B>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, ctype: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = ctype.parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    if req.method() != Method::GET {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET is served\n".into(),
        );
    }
    match req.uri().path() {
        "/metrics" => {
            // Prometheus asks for OpenMetrics; curl and older tools get the classic format.
            let open = req
                .headers()
                .get(hyper::header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("application/openmetrics-text"));
            if open {
                reply(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    source.metrics(),
                )
            } else {
                reply(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    classic(&source.metrics()),
                )
            }
        }
        "/state" => reply(
            StatusCode::OK,
            "application/json",
            source.state().to_string() + "\n",
        ),
        "/" => reply(
            StatusCode::OK,
            "text/plain",
            "mcsi: GET /metrics (Prometheus) or /state (JSON; mcsi monitor)\n".into(),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: GET /metrics or /state\n".into(),
        ),
    }
}

/// The classic text format (0.0.4) of an OpenMetrics exposition: a counter family's HELP and
/// TYPE carry the `_total` name its samples have, and the UNIT and EOF lines go.
pub fn classic(open: &str) -> String {
    let counters: std::collections::HashSet<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len());
    for line in open.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    out.push_str(&format!("{p}{name}_total {tail}"));
                } else {
                    out.push_str(line);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Milliseconds since the Unix epoch, for snapshots.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Empty;
    impl super::Source for Empty {
        fn metrics(&self) -> String {
            "# EOF\n".into()
        }
        fn state(&self) -> serde_json::Value {
            serde_json::json!({})
        }
    }

    /// Clients that connect and send nothing are closed after the header timeout and take no
    /// more than the cap; a client that asks is answered meanwhile, once a slot is free.
    #[tokio::test]
    async fn idle_clients_are_capped_and_timed_out() {
        let at = super::serve("127.0.0.1:0", std::sync::Arc::new(Empty))
            .await
            .expect("bound");
        let mut idle = Vec::new();
        for _ in 0..super::MAX_CONNECTIONS + 8 {
            idle.push(tokio::net::TcpStream::connect(at).await.expect("connect"));
        }
        // Those beyond the cap are closed at once.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let closed_now = idle
            .iter()
            .filter(|s| matches!(s.try_read(&mut [0u8; 1]), Ok(0)))
            .count();
        assert_eq!(closed_now, 8);
        // The others are closed by the header timeout.
        let t0 = std::time::Instant::now();
        for s in idle.iter_mut() {
            let mut b = [0u8; 64];
            let r = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut b)).await;
            assert!(matches!(r, Ok(Ok(_)) | Ok(Err(_))), "still open");
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        // Then a scrape is answered.
        let mut c = tokio::net::TcpStream::connect(at).await.expect("connect");
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("sent");
        let mut text = String::new();
        c.read_to_string(&mut text).await.expect("answer");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    #[test]
    fn openmetrics_counters_become_classic() {
        let open = "# HELP a_bytes Bytes.\n# TYPE a_bytes counter\n# UNIT a_bytes bytes\na_bytes_total{x=\"1\"} 5\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n# EOF\n";
        assert_eq!(
            super::classic(open),
            "# HELP a_bytes_total Bytes.\n# TYPE a_bytes_total counter\na_bytes_total{x=\"1\"} 5\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n"
        );
    }
}
