"""Write the stock twin of a TorchTitan TOML: "mega_moe" removed from ``[model] converters``,
every other byte unchanged.

    python scripts/ab_stock_toml.py train_configs/x_mega_moe.toml out/stock.toml
    python scripts/ab_stock_toml.py --drop-quantize train_configs/x_fp8.toml out/stock_bf16.toml

``--drop-quantize`` also removes every "quantize.*" converter (torchao's FP8 and MX
recipes), which leaves stock TorchTitan in bf16; their ``[quantize...]`` tables stay, unused.

TorchTitan's command line cannot express this override when the result is an empty list
(``--model.converters=`` parses as ``[""]``), hence a file.
"""

import argparse
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CONVERTER = "mega_moe"
QUANTIZE_PREFIX = "quantize."

_MODEL_HEADER = re.compile(r"^[ \t]*\[[ \t]*model[ \t]*\][ \t]*(#.*)?$", re.MULTILINE)
_NEXT_HEADER = re.compile(r"^[ \t]*\[", re.MULTILINE)
_CONVERTERS = re.compile(r"^([ \t]*converters[ \t]*=[ \t]*)\[.*?\]", re.MULTILINE | re.DOTALL)


def dropped(converters: list[str], drop_quantize: bool = False) -> list[str]:
    """The converters the stock twin leaves out: CONVERTER, and with ``drop_quantize`` every
    converter whose name starts with QUANTIZE_PREFIX."""
    return [name for name in converters
            if name == CONVERTER or (drop_quantize and name.startswith(QUANTIZE_PREFIX))]


def stock_toml(text: str, drop_quantize: bool = False) -> str:
    """Return ``text`` with the ``dropped`` converters removed from [model] converters;
    ValueError if CONVERTER is absent or if the rewrite cannot be done textually (e.g.
    dotted keys, inline tables)."""
    config = tomllib.loads(text)
    converters = config.get("model", {}).get("converters", [])
    if CONVERTER not in converters:
        raise ValueError(f'[model] converters = {converters} does not contain "{CONVERTER}"')
    removed = dropped(converters, drop_quantize)
    stock = [name for name in converters if name not in removed]

    header = _MODEL_HEADER.search(text)
    if header is None:
        raise ValueError("no [model] table header found; edit the converters by hand")
    body_start = header.end()
    next_header = _NEXT_HEADER.search(text, body_start)
    body_end = next_header.start() if next_header else len(text)
    body = text[body_start:body_end]
    replacement = "[" + ", ".join(f'"{name}"' for name in stock) + "]"
    new_body, count = _CONVERTERS.subn(lambda m: m.group(1) + replacement, body, count=1)
    new_text = text[:body_start] + new_body + text[body_end:]

    # The textual edit must change exactly that one value.
    config["model"]["converters"] = stock
    if count != 1 or tomllib.loads(new_text) != config:
        raise ValueError("could not rewrite [model] converters textually; edit the TOML by hand")
    return new_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("toml", help="TOML whose [model] converters contain mega_moe")
    parser.add_argument("out", help="where to write the stock copy")
    parser.add_argument("--drop-quantize", action="store_true",
                        help='also remove every "quantize.*" converter (stock in bf16)')
    args = parser.parse_args()
    # newline="": keep the file's line endings byte for byte.
    with open(args.toml, encoding="utf-8", newline="") as f:
        text = f.read()
    try:
        stock = stock_toml(text, args.drop_quantize)
    except ValueError as error:
        sys.exit(f"ab_stock_toml: {args.toml}: {error}")
    with open(args.out, "w", encoding="utf-8", newline="") as f:
        f.write(stock)
    removed = dropped(tomllib.loads(text)["model"]["converters"], args.drop_quantize)
    note = ""
    if args.drop_quantize and not any(name.startswith(QUANTIZE_PREFIX) for name in removed):
        note = f' (no "{QUANTIZE_PREFIX}*" converter to remove)'
    print(f"ab_stock_toml: wrote {args.out}: removed {', '.join(removed)} from [model] converters{note}")


if __name__ == "__main__":
    main()
