"""``dynsteer serve MODEL [vLLM serve options]``: vLLM's own ``vllm serve``, in this process, with steering endpoints.

Everything but ``--steering-allow-remote`` is vLLM's: the arguments are parsed by vLLM's serve parser and the server is
vLLM's ``ServeSubcommand.cmd``; dynsteer only adds its endpoint plugin (:mod:`dynsteer.engine.server`) first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

ALLOW_REMOTE = "--steering-allow-remote"


def serve_parser():
    """vLLM's ``serve`` parser with dynsteer's one option added."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="dynsteer", description="vLLM's OpenAI-compatible server with dynsteer's "
                                                                 "steering endpoints (/v1/steering/...).")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    serve = ServeSubcommand()
    sub = serve.subparser_init(subparsers)
    sub.usage = "dynsteer serve [model_tag] [vLLM serve options] [--steering-allow-remote]"
    group = sub.add_argument_group("dynsteer", "dynsteer's steering endpoints (/v1/steering/vectors, /policy, "
                                               "/capabilities); --help=dynsteer")
    group.add_argument(ALLOW_REMOTE, action="store_true", default=False,
                       help="with no --api-key, serve /v1/steering/* to non-loopback clients too "
                            "(default: loopback and unix-socket clients only)")
    sub.set_defaults(dispatch_function=serve.cmd)
    return parser, serve


def run_serve(argv: Sequence[str]) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    from dynsteer.engine.server import install

    cli_env_setup()
    parser, serve = serve_parser()
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    if getattr(args, "headless", False) or (args.api_server_count or 1) > 1 or getattr(args, "grpc", False):
        sys.exit("dynsteer serve: the steering endpoints need a single HTTP API server in this process "
                 "(no --headless, --grpc or --api-server-count > 1)")
    install(allow_remote=args.steering_allow_remote)
    args.dispatch_function(args)
