"""p2ptrain: an asyncio gRPC peer-to-peer runtime for decentralized deep-learning training."""
__version__ = "0.1.0"

from p2ptrain.config import NodeConfig  # noqa: E402

__all__ = ["NodeConfig", "__version__"]
