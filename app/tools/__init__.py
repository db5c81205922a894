"""Tools the model can call: MCP servers (stdio or HTTP, through the official `mcp` SDK), the
registry of their tools, and the dialog that manages them."""
