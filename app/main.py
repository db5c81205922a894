"""`kvscope`: the desktop app's entry point.

kvscope                                   the model you loaded last (the packaged default at first)
kvscope --model PATH --dtype bfloat16     another model for this launch
kvscope --quantization int8-weight-only --kv-dtype int8
                                          quantized weights and an int8 KV cache for this launch
kvscope --prompt TEXT --screenshot out.png --quit-after-reply
                                          scripted: load the default model, send TEXT, wait for the
                                          whole reply, save a screenshot of the window, exit 0
kvscope --prompt TEXT --n 3 / --num-beams 3
                                          the reply as 3 samples, or by beam search with 3 beams
kvscope --attach http://127.0.0.1:8000 [--api-key KEY]
                                          chat with a remote OpenAI-compatible server (vLLM, SGLang,
                                          llama.cpp, kvscope serve) instead of loading a model
kvscope serve --model ... [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                                          no window: the engine behind an OpenAI-compatible HTTP API
                                          (the same as `python -m engine serve`)
kvscope generate --prompt TEXT --json     the headless engine CLI (generate, chat, inspect-model,
                                          bench, ...; the same as `python -m engine`): the frozen
                                          app has no Python to run `-m engine` with
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Offline before anything imports transformers or huggingface_hub: loading never downloads (the
# model browser goes online for the search or download the user asks for, unless they set
# HF_HUB_OFFLINE themselves).
from engine.api import offline_by_default  # noqa: E402

offline_by_default()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A first load converts the packaged GGUF and a slow disk can take minutes; beyond this a
# scripted run reports failure instead of hanging a CI job.
SCRIPTED_TIMEOUT_S = 900.0

# Exit status when kvscope cannot start here at all (no usable Qt platform, unwritable folders).
EXIT_CANNOT_START = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.config import DEVICES, DTYPES, KV_DTYPES

    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Chat with a local LLM while watching its inference live.",
        epilog="kvscope COMMAND ... runs the headless engine instead of the window, COMMAND one of "
        f"{', '.join(engine_commands())} (kvscope generate --help).",
    )
    parser.add_argument(
        "--model",
        metavar="SOURCE",
        help="'default' (the packaged SmolLM2), a model folder, a .gguf file or a repo id in the local "
        "Hugging Face cache (a GGUF repo's one .gguf file; REPO:FILE picks one of several) (default: "
        "the model loaded last; 'default' for scripted runs)",
    )
    parser.add_argument(
        "--gguf-file", metavar="FILE", help="with a repo id as --model: which of its .gguf files to load"
    )
    parser.add_argument("--dtype", choices=DTYPES, help="weight and KV precision")
    parser.add_argument("--device", choices=DEVICES, help="where to run the model")
    parser.add_argument(
        "--quantization",
        metavar="NAME",
        help="weight quantization scheme applied at load ('none', 'int8-weight-only', ...; "
        "`python -m engine quant-report --list` lists them with whether they run here)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="KV-cache storage: auto (the model's dtype; float16 for a GGUF at its own bits), float16 or int8",
    )
    parser.add_argument("--block-size", type=int, metavar="N", help="tokens per KV-cache page")
    parser.add_argument(
        "--kv-budget-mib", type=int, metavar="MIB", help="memory for the KV-cache pool (0 = auto)"
    )
    parser.add_argument("--prompt", metavar="TEXT", help="send this message once the model is loaded")
    parser.add_argument(
        "--screenshot", metavar="PATH", type=Path, help="after the reply, save the window as PNG"
    )
    parser.add_argument(
        "--quit-after-reply", action="store_true", help="exit once the reply (and screenshot) is done"
    )
    parser.add_argument(
        "--n",
        type=int,
        metavar="N",
        help="generate replies as N parallel samples (set in the Sampling controls, kept like an edit there)",
    )
    parser.add_argument(
        "--num-beams",
        type=int,
        metavar="K",
        help="generate replies by beam search with K beams; beam search scores, it does not sample, so "
        "this also sets temperature 0 and clears stop strings (kept like an edit in the Sampling controls)",
    )
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument(
        "--json-schema", metavar="FILE", type=Path, help="the chat's replies follow this JSON Schema"
    )
    grammar.add_argument("--regex", metavar="R", help="the chat's replies match this regular expression")
    grammar.add_argument(
        "--grammar",
        metavar="FILE",
        type=Path,
        help="the chat's replies follow this Lark or GBNF (.gbnf) grammar",
    )
    parser.add_argument(
        "--attach",
        metavar="URL",
        help="attach to a remote OpenAI-compatible server instead of loading a model (Remote menu)",
    )
    parser.add_argument("--api-key", metavar="KEY", help="the API key of the --attach server")
    parser.add_argument(
        "--timeout",
        type=float,
        default=SCRIPTED_TIMEOUT_S,
        metavar="S",
        help="scripted runs give up after S seconds",
    )
    args = parser.parse_args(argv)
    if (args.screenshot or args.quit_after_reply) and not args.prompt:
        parser.error("--screenshot and --quit-after-reply need --prompt")
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt must not be empty")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.api_key and not args.attach:
        parser.error("--api-key needs --attach")
    if args.gguf_file:
        if not args.model:
            parser.error("--gguf-file needs --model REPO (a repo id in the local Hugging Face cache)")
        from engine.api import ModelLoadError, with_gguf_file

        try:
            args.model = with_gguf_file(args.model, args.gguf_file)
        except ModelLoadError as exc:
            parser.error(str(exc))
    return args


def structured_output(args: argparse.Namespace):
    """The chat's structured output from --json-schema / --regex / --grammar (None without one);
    ConfigError saying what is wrong with it, before anything starts."""
    from engine.api import check_grammar
    from engine.config import ConfigError, GrammarSpec

    if args.regex is not None:
        flag, kind, text = "--regex", "regex", args.regex
    elif args.json_schema is not None or args.grammar is not None:
        path = args.json_schema or args.grammar
        flag = "--json-schema" if args.json_schema is not None else "--grammar"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"{flag}: cannot read {path}: {reason}") from None
        if args.json_schema is not None:
            kind = "json_schema"
        else:
            kind = "gbnf" if path.suffix == ".gbnf" or (path.suffix != ".lark" and "::=" in text) else "lark"
    else:
        return None
    spec = GrammarSpec(kind, text)
    problem = check_grammar(spec)
    if problem:
        raise ConfigError(f"{flag}: {problem}")
    return spec


def model_choice(args: argparse.Namespace, saved):
    """The launch's model: command-line values over the saved choice. A scripted run starts from
    the packaged default, not from whatever the user loaded last, so it is reproducible."""
    import dataclasses

    from app.settings import ModelChoice
    from engine.api import check_scheme_name

    base = ModelChoice() if args.prompt else saved
    overrides = {
        "source": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "quantization": args.quantization,
        "kv_dtype": args.kv_dtype,
        "block_size": args.block_size,
        "kv_budget_mib": args.kv_budget_mib,
    }
    choice = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    choice.engine_config()  # raises ConfigError with a message for bad numbers
    check_scheme_name(choice.quantization)  # an unknown scheme name: a ConfigError naming the choices
    return choice


def group_sampling(args: argparse.Namespace, params):
    """The launch's sampling with --n / --num-beams applied (ConfigError for a bad combination)."""
    import dataclasses

    from engine.config import SamplingParams

    if args.n is None and args.num_beams is None:
        return params
    values = dataclasses.asdict(params)
    # Each flag chooses the mode: the other one's saved value (from an earlier launch) is reset;
    # giving both is refused by SamplingParams with its message.
    values.update(
        n=args.n if args.n is not None else 1, num_beams=args.num_beams if args.num_beams is not None else 1
    )
    if args.num_beams is not None:
        values.update(temperature=0.0, stop=())
    return SamplingParams(**values)


def engine_commands() -> tuple[str, ...]:
    from engine.api import command_names

    return command_names()


def show_startup_error(message: str) -> None:
    """A dialog for a person who started kvscope from a menu, where stderr goes unseen."""
    from PySide6.QtWidgets import QMessageBox

    QMessageBox.critical(None, "kvscope cannot start", message)


def startup_failed(message: str, interactive: bool) -> int:
    print(f"kvscope: {message}", file=sys.stderr)
    if interactive:
        show_startup_error(message)
    return EXIT_CANNOT_START


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in engine_commands():
        from engine.api import cli_main

        return cli_main(argv, prog="kvscope")
    args = parse_args(argv)

    from app.startup import platform_problem

    # Before the QApplication: without a platform Qt aborts with no library named.
    problem = platform_problem()
    if problem is not None:
        return startup_failed(problem, interactive=False)

    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.chat.conversations import StorageError
    from app.chat.db_recovery import open_conversations
    from app.paths import DirectoryError, asset_path, conversations_db_path
    from app.runtime import configure_for_gui
    from app.scripted import ScriptedRun
    from app.settings import AppSettings
    from app.wheel_guard import install_wheel_guard
    from app.window import MainWindow
    from engine.config import ConfigError
    from widgets.theme import apply_theme

    configure_for_gui()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    # Wayland matches the window to its desktop entry (and icon) by this name.
    app.setDesktopFileName("io.github.kvscope.kvscope")
    app.setWindowIcon(QIcon(str(asset_path("kvscope.svg"))))
    apply_theme(app, asset_path("style.qss"))
    install_wheel_guard(app)  # the wheel scrolls panes; it turns only the field being edited

    scripted = args.prompt is not None
    try:
        settings = AppSettings()
        # Interactive: a database that cannot be opened gets a dialog (set it aside, or quit).
        conversations = open_conversations(conversations_db_path(), interactive=not scripted)
    except (DirectoryError, StorageError) as exc:
        return startup_failed(str(exc), interactive=not scripted)
    if conversations is None:
        print(
            f"kvscope: the conversation database at {conversations_db_path()} was left as it is",
            file=sys.stderr,
        )
        return 2
    try:
        choice = model_choice(args, settings.model_choice())
        grammar = structured_output(args)
    except ConfigError as exc:
        print(f"kvscope: {exc}", file=sys.stderr)
        conversations.close()
        return 2

    target = None
    if args.attach:
        from app.remote.target import RemoteTarget, TargetError

        try:
            target = RemoteTarget.parse(args.attach, args.api_key)
        except TargetError as exc:
            print(f"kvscope: --attach: {exc}", file=sys.stderr)
            return 2
    window = MainWindow(settings, conversations, interactive=not scripted)
    try:
        window.controls.sampling.set_params(group_sampling(args, window.controls.sampling.params()))
    except ConfigError as exc:
        print(f"kvscope: {exc}", file=sys.stderr)
        window.close()
        return 2
    if (
        args.model
        or args.dtype
        or args.device
        or args.quantization
        or args.kv_dtype
        or args.block_size is not None
        or args.kv_budget_mib is not None
    ):
        window.controls.model.set_choice(choice)
    if grammar is not None:
        from app.chat.chat_settings import ChatSettings

        window.controller.set_chat_settings(ChatSettings(grammar=grammar))
    window.show()
    run = None
    if scripted:
        run = ScriptedRun(window, args.prompt, args.screenshot, args.quit_after_reply, args.timeout)
        run.done.connect(app.exit)
    if target is not None:
        if run is not None:  # a server other than kvscope sends no ModelLoaded: ready when it answers
            window.host.source_changed.connect(
                lambda s: s is not None and not s.events and run._on_loaded(None)
            )
        window.remote_views.attach(target)
    else:  # once the picker has read the model's estimate, shown beside what the load measures
        window.controls.model.after_estimate(lambda: window.start_engine(choice.engine_config()))
    code = app.exec()
    conversations.close()
    return run.exit_code if run is not None and run.finished else code


if __name__ == "__main__":
    sys.exit(main())
