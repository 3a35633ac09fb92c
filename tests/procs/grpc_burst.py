"""Run by tests/test_grpc_wakeups.py in a process of its own: `CALLS` grpc.aio calls to a sync
server in another process answer while the event loop is busy (blocked 3 s); prints where
grpc.aio's poller thread waits meanwhile (its /proc wchan), then how many calls succeeded and
how many ran out their deadline (stderr: how the others failed).
With `fix`, p2ptrain.transport.grpc_wakeups makes the wake-up sockets non-blocking first."""
import asyncio
import subprocess
import sys
import threading
import time

import grpc

from p2ptrain.transport.grpc_wakeups import never_block_the_poller

SERVER = """
import sys, grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(8))
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    "t.T", {"E": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
"""


async def burst(calls: int, fix: bool) -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{int(server.stdout.readline())}")
        echo = channel.unary_unary("/t.T/E")
        await echo(b"x")
        if fix:
            never_block_the_poller()
        tasks = [asyncio.ensure_future(echo(b"x", timeout=60)) for _ in range(calls)]
        await asyncio.sleep(0.3)  # (every call on its way)
        time.sleep(3)  # the loop is busy while the answers come in: their wake-up bytes pile up
        poller = next(t for t in threading.enumerate() if "_poll_wrapper" in t.name)
        with open(f"/proc/self/task/{poller.native_id}/wchan") as wchan:
            print(wchan.read().strip() or "-", flush=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        timed_out = sum(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        for r in results)
        print(sum(result == b"x" for result in results), timed_out, flush=True)
        print(sorted({repr(r)[:200] for r in results if r != b"x"})[:5], file=sys.stderr, flush=True)
        await channel.close()
    finally:
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    asyncio.run(burst(int(sys.argv[1]), sys.argv[2] == "fix"))
