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

/// Binds `addr` and serves until the runtime ends. Returns the bound address.
pub async fn serve(addr: &str, source: Arc<dyn Source>) -> anyhow::Result<SocketAddr> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--metrics {addr}: expected IP:PORT, e.g. 127.0.0.1:9464"))?;
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics: cannot listen on {addr}"))?;
    let local = l.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = l.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let source = source.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let source = source.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(&*source, &req)) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
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
    #[test]
    fn openmetrics_counters_become_classic() {
        let open = "# HELP a_bytes Bytes.\n# TYPE a_bytes counter\n# UNIT a_bytes bytes\na_bytes_total{x=\"1\"} 5\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n# EOF\n";
        assert_eq!(
            super::classic(open),
            "# HELP a_bytes_total Bytes.\n# TYPE a_bytes_total counter\na_bytes_total{x=\"1\"} 5\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n"
        );
    }
}
