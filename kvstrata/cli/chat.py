"""`kvstrata chat`: a multi-turn session over the persistent store, hit / replay / miss per turn.

A script file holds turns separated by lines of `---`; in a turn, a line that starts with `System:`,
`User:`, `Tool result:` (or `Tool:`) or `Assistant:` starts a message of that role, other lines go on
with the message before (a turn's first lines, before any label, are the user's). A trailing empty
`Assistant:` line is a cue and is dropped: the chat template opens the assistant's turn itself.
"""

from __future__ import annotations

import re
import sys

from kvstrata.cli.inputs import BIG, int_in, nonempty
from kvstrata.cli.serve import REPLAY_HELP, replay_tokens


def register(sub) -> None:
    ch = sub.add_parser("chat",
                        help="multi-turn session over the persistent store: hit / replay / miss per turn")
    ch.add_argument("--model", default="gemma3-270m",
                    help="a known model (`kvstrata models`), tiny-llama / tiny-gemma3, or a local model "
                         "directory; gemma3-270m has sliding layers, so a lost SWA state shows a replay")
    ch.add_argument("--method", default="nvfp4;sliding=fp8", type=nonempty,
                    help="method spec the store keeps KV in (`kvstrata methods`)")
    ch.add_argument("--script",
                    help="UTF-8 file of turns separated by lines of '---', messages labelled System: / "
                         "User: / Tool result: / Assistant: (docs/examples/agent_turns.txt; default: one "
                         "user turn per stdin line)")
    ch.add_argument("--config", help="store TOML ([store] table); env KVSTRATA_STORE_* also apply")
    ch.add_argument("--tenant", default="default", type=nonempty,
                    help="the store's tenant: its blocks are keyed by it, so another tenant never reads them")
    ch.add_argument("--max-new-tokens", type=int_in(1, 100_000), default=32, help="most tokens per answer")
    ch.add_argument("--forget-swa-before", type=int_in(1, BIG), nargs="*",
                    help="turn numbers before which the SWA pool is emptied")
    ch.add_argument("--replay-tokens", type=replay_tokens, help=REPLAY_HELP)
    ch.set_defaults(func=run)


ROLE = re.compile(r"^(System|User|Tool result|Tool|Assistant):[ \t]?", re.I)
ROLES = {"system": "system", "user": "user", "tool result": "tool", "tool": "tool", "assistant": "assistant"}


def script_turns(text: str) -> list[list[dict[str, str]]]:
    """A script's turns, each a list of `{"role", "content"}` messages (empty turns dropped)."""
    turns = []
    for chunk in re.split(r"\n---[ \t]*(?:\n|$)", text.replace("\r\n", "\n")):
        messages: list[dict[str, str]] = []
        for line in chunk.split("\n"):
            label = ROLE.match(line)
            if label:
                messages.append({"role": ROLES[label[1].lower()], "content": line[label.end():]})
            elif messages:
                messages[-1]["content"] += "\n" + line
            elif line.strip():
                messages.append({"role": "user", "content": line})
        messages = [{**m, "content": m["content"].strip()} for m in messages]
        messages = [m for m in messages if m["content"]]  # the empty `Assistant:` cue, blank messages
        if messages:
            turns.append(messages)
    return turns


def run(args) -> int:
    from kvstrata.cli.inputs import model_name

    model_name(args.model)  # a mistyped model is named at once (before torch loads)

    from kvstrata.cli.inputs import SCRIPT_MAX_BYTES, check_fits
    from kvstrata.methods import parse_method
    from kvstrata.models import check_method, load_config, load_model, load_tokenizer
    from kvstrata.place import KVStore, StoreConfig
    from kvstrata.place.chat import Conversation, chat
    from kvstrata.place.prefix_server import PrefixServer
    from kvstrata.user_files import read_text_file

    parse_method(args.method)  # then a bad spec, even when the config is bad too
    cfg = StoreConfig.load(args.config)
    script = read_text_file(args.script, "--script", SCRIPT_MAX_BYTES) if args.script else None
    turns = script_turns(script) if script is not None else [t.strip() for t in sys.stdin if t.strip()]
    if script is not None and not turns:
        raise ValueError(f"--script: {args.script} holds no turns")
    check_method(args.model, args.method, store=True)  # before the store opens and the weights load
    tok = load_tokenizer(args.model)
    first = len(Conversation(tok).prompt(turns[0])) if turns else 1
    check_fits(load_config(args.model), first, args.max_new_tokens, "the first turn")
    if not tok.chat_template:
        print(f"chat: {args.model} has no chat template (a base model): turns are fed as 'User: ...' / "
              "'Assistant:' lines and its answers continue that text", file=sys.stderr)
    store = KVStore.from_config(cfg)
    model = load_model(args.model)
    server = PrefixServer(model, store, args.method, block_size=cfg.block_size, n_win=args.replay_tokens,
                          tenant=args.tenant.encode())
    chat(model, tok, server, turns, args.max_new_tokens, set(args.forget_swa_before or []), out=sys.stdout)
    return 0
