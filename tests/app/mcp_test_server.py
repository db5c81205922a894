"""A small MCP server written with the official `mcp` SDK, for the app's tool tests: run as
`python mcp_test_server.py` (stdio) or `python mcp_test_server.py http PORT` (Streamable HTTP).
Its tools: `add` two small integers, `echo` a short text, and the bad ones a client must survive:
`hang` (never answers), `crash` (raises) and `big` (10 MB)."""

from __future__ import annotations

import sys
import time
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

server = MCPServer("kvscope-test")


# Bounded arguments: a random test model writing them under the call's grammar ends them soon.
Digit = Annotated[int, Field(ge=0, le=9)]


@server.tool(description="Add two one-digit integers")
def add(a: Digit, b: Digit) -> str:
    return str(a + b)


@server.tool(description="Say a short text back")
def echo(text: Annotated[str, Field(max_length=12)]) -> str:
    return f"echo: {text}"


@server.tool(description="Never answers")
def hang() -> str:
    time.sleep(3600)
    return "never"


@server.tool(description="Always fails")
def crash() -> str:
    raise RuntimeError("the tool broke on purpose")


@server.tool(description="Returns ten megabytes")
def big() -> str:
    return "x" * (10 * 2**20)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run("stdio")
