"""`python -m aenv.envd`: run envd by hand or from tests.

    python -m aenv.envd --port 49983 [--host 0.0.0.0] [--token T] [--user U]
                        [--workdir D] [--env KEY=VALUE ...] [--not-init]
"""

from __future__ import annotations

import sys

from aenv.envd.lean import block_ssl

# This process is envd and nothing else: it can do without TLS (see aenv.envd.lean).
block_ssl()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from aenv.envd.settings import EnvdSettings

    parser = argparse.ArgumentParser(prog="python -m aenv.envd", description="aenv in-sandbox agent")
    parser.add_argument("--port", type=int, default=49983)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--token", default=None, help="access token (default: no token checks)")
    parser.add_argument("--user", default="user", help="default user")
    parser.add_argument("--workdir", default=None, help="default working directory")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--metadata-dir", default=EnvdSettings.metadata_dir)
    parser.add_argument("--not-init", action="store_true", help="do not reap processes we did not start")
    args = parser.parse_args(argv)
    env_vars = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env expects KEY=VALUE, got {item!r}")
        env_vars[key] = value
    settings = EnvdSettings(
        port=args.port,
        host=args.host,
        access_token=args.token,
        env_vars=env_vars,
        default_user=args.user,
        default_workdir=args.workdir,
        is_init=not args.not_init,
        metadata_dir=args.metadata_dir,
    )
    del parser, args, argparse
    sys.modules.pop("argparse", None)

    from aenv.envd.server import run

    run(settings)


if __name__ == "__main__":
    main()
