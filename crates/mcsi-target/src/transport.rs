//! What a connection runs over ([`Transport`]): a TCP socket from a portal, or any byte stream.

use tokio::net::TcpStream;

/// What a connection runs over: a TCP socket (the portals), or any byte stream handed to
/// [`crate::Server::serve`] (an in-process pipe for tests and fuzzing). Everything above it is the same.
pub trait Transport: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {
    type Read: tokio::io::AsyncRead + Unpin + Send + 'static;
    type Write: tokio::io::AsyncWrite + Unpin + Send + 'static;
    /// Reader and writer halves, each driven by its own task.
    fn split(self) -> (Self::Read, Self::Write);
    /// The TCP socket under it (no-delay, congestion control, TCP_INFO for reports); `None` for
    /// a stream that is not TCP.
    fn socket(&self) -> Option<socket2::SockRef<'_>>;
    /// The stream taken off the runtime it is registered with, to move to a session's thread.
    type Detached: Send + 'static;
    fn detach(self) -> std::io::Result<Self::Detached>;
    /// Registers a detached stream with the runtime this is called in.
    fn attach(d: Self::Detached) -> std::io::Result<Self>
    where
        Self: Sized;
}

impl Transport for TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn socket(&self) -> Option<socket2::SockRef<'_>> {
        Some(socket2::SockRef::from(self))
    }
    type Detached = std::net::TcpStream;
    fn detach(self) -> std::io::Result<std::net::TcpStream> {
        self.into_std()
    }
    fn attach(d: std::net::TcpStream) -> std::io::Result<Self> {
        TcpStream::from_std(d)
    }
}

impl Transport for tokio::io::DuplexStream {
    type Read = tokio::io::ReadHalf<Self>;
    type Write = tokio::io::WriteHalf<Self>;
    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
    fn socket(&self) -> Option<socket2::SockRef<'_>> {
        None
    }
    /// Not tied to a runtime's I/O driver: it moves as it is.
    type Detached = Self;
    fn detach(self) -> std::io::Result<Self> {
        Ok(self)
    }
    fn attach(d: Self) -> std::io::Result<Self> {
        Ok(d)
    }
}
