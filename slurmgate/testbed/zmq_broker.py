"""A ZMQ broker for Dynamo's event plane: XSUB for publishers, XPUB for subscribers, where told.

Dynamo's event plane in ZMQ's direct mode binds each publisher's socket to 0.0.0.0, whatever
DYN_EVENT_PLANE_HOST says; in broker mode (DYN_ZMQ_BROKER_URL) every process connects to a
broker instead, and only the broker listens, where it is told. Dynamo's own broker is a Rust
binary its wheels do not ship; this is the same forwarder (`zmq.proxy` between an XSUB and an
XPUB socket) on pyzmq, a dependency of ai-dynamo, so it runs with the Dynamo venv's Python:
``.venv-dynamo/bin/python -m slurmgate.testbed.zmq_broker tcp://127.0.0.1:P1 tcp://127.0.0.1:P2``.
"""

from __future__ import annotations

import sys


def serve(xsub: str, xpub: str) -> None:
    """Forward every message from the publishers on `xsub` to the subscribers on `xpub`, and
    their subscriptions back, until the process is stopped."""
    import zmq

    context = zmq.Context()
    front = context.socket(zmq.XSUB)
    front.bind(xsub)
    back = context.socket(zmq.XPUB)
    back.bind(xpub)
    print(f"forwarding {xsub} -> {xpub}", flush=True)
    zmq.proxy(front, back)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m slurmgate.testbed.zmq_broker XSUB_URL XPUB_URL", file=sys.stderr)
        return 2
    serve(args[0], args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
