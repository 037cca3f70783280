"""Interoperability check with a client nobody on this project wrote: the official Python MCP SDK.

Lists the tools, calls each one (on a scaffold in a temporary workspace and the real BabyLlama
checkpoint), reads resources and gets a prompt. Prints one line per check and a closing
'N passed, M failed' line; exits non-zero on any failure.

Usage: python3 tests/interop/python_client.py PATH/TO/metainfer MODEL_DIR
"""

import asyncio
import json
import os
import sys
import tempfile

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

TOOLS = {
    "plan_engine", "lookup_contract", "scaffold_engine", "compile_engine",
    "run_kernel_test", "verify_generation", "profile_engine", "check_rules",
}

results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}", flush=True)


def attr(o, snake, camel):
    """The SDK renamed fields to snake_case in newer versions; accept both."""
    return getattr(o, snake, None) if hasattr(o, snake) else getattr(o, camel, None)


def structured(r):
    return attr(r, "structured_content", "structuredContent") or {}


def is_error(r):
    return bool(attr(r, "is_error", "isError"))


async def main(binary, model):
    work = tempfile.mkdtemp(prefix="metainfer-interop-")
    params = StdioServerParameters(
        command=binary,
        args=["serve", "--workspace", work, "--model-dir", model],
        env={**os.environ},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            init = await s.initialize()
            check("initialize: server name", attr(init, "server_info", "serverInfo").name == "metainfer")
            tools = (await s.list_tools()).tools
            names = {t.name for t in tools}
            check("tools/list names", TOOLS <= names, str(sorted(names)))
            check("every tool has input and output schema",
                  all(attr(t, "input_schema", "inputSchema") and attr(t, "output_schema", "outputSchema") for t in tools))

            r = await s.call_tool("lookup_contract", {"id": "kernel.rope"})
            check("lookup_contract", not is_error(r) and structured(r).get("contracts", [{}])[0].get("id") == "kernel.rope",
                  str(r.content[:1]))
            r = await s.call_tool("plan_engine", {"model": model})
            check("plan_engine", not is_error(r) and structured(r).get("covered") is True, str(r.content[:1]))
            engine = os.path.join(work, "engine")
            r = await s.call_tool("scaffold_engine", {"model": model, "out": engine})
            check("scaffold_engine", not is_error(r) and os.path.isfile(os.path.join(engine, "src", "kernels.rs")),
                  str(r.content[:1]))
            r = await s.call_tool("compile_engine", {"engine": engine})
            check("compile_engine (bare scaffold compiles)", not is_error(r) and structured(r).get("passed") is True,
                  str(r.content[:1]))
            r = await s.call_tool("run_kernel_test", {"engine": engine, "kernels": ["kernel.argmax"]})
            check("run_kernel_test (bare scaffold fails)", not is_error(r) and structured(r).get("passed") is False,
                  str(r.content[:1]))
            r = await s.call_tool("verify_generation", {"engine": engine, "model": model, "max_new_tokens": 4})
            check("verify_generation (bare scaffold fails)", not is_error(r) and structured(r).get("passed") is False,
                  str(r.content[:1]))
            r = await s.call_tool("profile_engine", {"engine": engine, "model": model, "runs": 1})
            check("profile_engine (bare scaffold fails)", not is_error(r) and structured(r).get("passed") is False,
                  str(r.content[:1]))
            r = await s.call_tool("check_rules", {"engine": engine})
            check("check_rules (bare scaffold is clean)", not is_error(r) and structured(r).get("passed") is True,
                  str(r.content[:1]))
            r = await s.call_tool("lookup_contract", {"id": "kernel.unknown"})
            check("bad request is a tool error", is_error(r))

            res = await s.read_resource("ckb://contract/kernel.rms_norm")
            check("resources/read contract", "kernel.rms_norm" in res.contents[0].text)
            res = await s.list_resources()
            check("resources/list", any(str(x.uri) == "ckb://coverage" for x in res.resources))
            p = await s.get_prompt("generate_engine", {"model": model})
            check("prompts/get", model in json.dumps(p.model_dump(mode="json")))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], os.path.abspath(sys.argv[2])))
    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
