"""The ways a message reaches a peer: the gRPC path, the TCP lane, relayed via another node; the
router picks one per message. Each raises the transport's own SendFailure, never a library's error."""
