"""`trainwell data-service`: a local tf.data service dispatcher and N workers, until Ctrl-C.

The service itself is `trainwell.data.service.start_local_service`; this module is the
command's part: its arguments, the line it prints (the dispatcher's address, for the
ResNet recipe's `data_service`), and stopping the servers on Ctrl-C (or after `--seconds`).
A bad argument is one line and exit status 2 (`trainwell.cli.main` prints a `ConfigError`).

Example:
>>> import argparse
>>> p = argparse.ArgumentParser(); add_data_service_parser(p.add_subparsers())
>>> p.parse_args(["data-service", "--workers", "2"]).workers
2
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from trainwell.config import ConfigError
from trainwell.validation import invalid_value

__all__ = ["add_data_service_parser", "cmd_data_service"]


def cmd_data_service(args) -> int:
    """Starts the dispatcher and `args.workers` workers, prints the target, serves until Ctrl-C. Returns 0.

    Example:
    >>> import argparse
    >>> cmd_data_service(argparse.Namespace(workers=0, port=0, seconds=None))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainwell.config.ConfigError: Invalid value for argument `workers`. ... Received: workers=0
    """
    # lazy: TensorFlow loads when the command runs, not when the parser is built
    from trainwell.data.service import start_local_service

    if args.seconds is not None and not args.seconds > 0:
        raise invalid_value("--seconds", "a number > 0 (or no --seconds: until Ctrl-C)", args.seconds, what="",
                            error=ConfigError)
    try:
        service = start_local_service(workers=args.workers, port=args.port)
    except ValueError as e:  # an argument's "Received:" line: a usage error, exit 2
        raise ConfigError(str(e)) from None
    # Ctrl-C, `kill -INT` and `kill` all stop the servers cleanly (put back after): a shell starts a
    # background job (`trainwell data-service ... &`) with SIGINT ignored, where `kill -INT` did nothing.
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    before = {sig: signal.signal(sig, signal.default_int_handler)
              for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        print(f"tf.data service: dispatcher {service.target}, {len(service.workers)} worker(s) on 127.0.0.1 "
              "(the dispatcher listens on every interface: keep its port behind a firewall)")
        print(f"  train with: --set data_service={service.target}    (Ctrl-C stops the service)")
        sys.stdout.flush()
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.1 if deadline is not None else 1.0)
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    print("tf.data service stopped")
    return 0


def add_data_service_parser(sub) -> None:
    """Adds the `data-service` command to `sub` (an `add_subparsers()` result).

    Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_data_service_parser(p.add_subparsers())
    >>> p.parse_args(["data-service"]).port
    0
    """
    ds = sub.add_parser("data-service", help="run a local tf.data service (dispatcher + N workers) until Ctrl-C")
    ds.add_argument("--workers", type=int, default=1, metavar="N", help="worker servers (default 1)")
    ds.add_argument("--port", type=int, default=0, metavar="P", help="the dispatcher's port (default: a free one)")
    ds.add_argument("--seconds", type=float, metavar="S", help="stop after S seconds (default: until Ctrl-C)")
    ds.set_defaults(func=cmd_data_service)
