"""A small synthetic multi-turn agent dataset with reasoning and tool calls, generated offline and seeded.

Each row is one agent trajectory in TRL's conversational format: a ``messages`` column (system, user,
assistant turns with ``reasoning_content`` and OpenAI-style ``tool_calls``, ``tool`` results, follow-up
user turns) and a ``tools`` column (JSON text of the tool schemas, as TRL stores it). Per-turn training
samples of such trajectories share long prefixes, and a template that strips earlier reasoning (Qwen3's)
makes them fork at every new user turn: the tree-shaped data hf_tree is for.

Everything comes from ``random.Random(seed)``: the same arguments always give the same rows.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from typing import Any

import datasets

# The main job's data (hf_tree.launcher's defaults for builtin:synthetic-agent), which `hf-tree stats
# builtin:synthetic-agent` reports on too: the same trees as the job trains.
MAIN_JOB_CONVERSATIONS = 24
MAIN_JOB_OPTIONS = {"max_user_turns": 2, "max_tool_steps": 1}

CITIES = ["Paris", "Lisbon", "Osaka", "Toronto", "Nairobi", "Oslo", "Lima", "Hanoi", "Krakow", "Denver"]
TICKERS = {"ACME": "Acme Corp", "GLBX": "Globex", "INTC": "Initech", "UMBR": "Umbrella", "STRK": "Stark Industries"}
TABLES = {
    "orders": ["order_id", "customer_id", "amount", "created_at", "status"],
    "customers": ["customer_id", "name", "country", "signup_date"],
    "tickets": ["ticket_id", "customer_id", "priority", "opened_at", "closed_at"],
}
FILES = ["src/app/config.py", "src/app/server.py", "src/app/db.py", "src/app/settings.py", "deploy/settings.py"]
TOPICS = ["rate limits", "authentication tokens", "retry policy", "the export API", "webhook signatures"]

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather and a 3-day forecast for a city.",
        "parameters": {"city": ("string", "City name, e.g. 'Paris'."), "units": ("string", "'metric' or 'imperial'.")},
        "required": ["city"],
    },
    {
        "name": "get_stock_price",
        "description": "Latest price, daily change and volume of a stock ticker.",
        "parameters": {"ticker": ("string", "Exchange ticker symbol, e.g. 'ACME'.")},
        "required": ["ticker"],
    },
    {
        "name": "run_sql",
        "description": "Run a read-only SQL query on the analytics warehouse and return rows.",
        "parameters": {
            "query": ("string", "A single SELECT statement."),
            "limit": ("integer", "Maximum rows to return."),
        },
        "required": ["query"],
    },
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"expression": ("string", "Expression using + - * / ( ) and decimals.")},
        "required": ["expression"],
    },
    {
        "name": "read_file",
        "description": "Read a text file of the user's repository.",
        "parameters": {"path": ("string", "Repository-relative path.")},
        "required": ["path"],
    },
    {
        "name": "search_docs",
        "description": "Search the product documentation and return the best passages.",
        "parameters": {"query": ("string", "Search terms."), "top_k": ("integer", "Passages to return.")},
        "required": ["query"],
    },
]

SYSTEM_PROMPTS = [
    "You are Atlas, an operations assistant for a mid-sized online retailer. You can call tools to look up live "
    "data. Think step by step before acting, call at most one tool at a time, never invent numbers that a tool "
    "did not return, and finish with a short, direct answer that cites the figures you used.",
    "You are a careful analyst agent. Use the available tools whenever a question depends on current data, "
    "explain your plan briefly in your reasoning, double-check arithmetic with the calculator, and state "
    "uncertainty plainly. Keep final answers under six sentences unless the user asks for detail.",
    "You are a coding and support assistant with read access to the user's repository and documentation. "
    "Investigate before answering: read the relevant files or docs, reason about what you found, and propose "
    "concrete next steps. Quote file paths exactly and do not guess configuration values.",
]

REASONING_OPENERS = [
    "The user wants {goal}.",
    "I need to figure out {goal}.",
    "The question is about {goal}.",
    "Before answering, I should establish {goal}.",
]
REASONING_STEPS = [
    "I do not have this information in the conversation yet, so a tool call is required.",
    "The most direct source is the {tool} tool; its output will tell me what I need.",
    "I should be careful not to assume values that the tool has not returned.",
    "Once I have the result I can compare it with what the user mentioned earlier.",
    "If the result looks inconsistent I will check it with a second call rather than guess.",
    "The previous tool output covers part of this, but one more lookup is needed.",
]
CONCLUSION_STEPS = [
    "I now have everything needed to answer.",
    "The tool results are consistent with each other.",
    "The numbers line up, so I can summarise them.",
    "I should mention the main figure first and then the caveat.",
    "The user asked for a recommendation, so I will end with one clear suggestion.",
]
DOC_PASSAGES = [
    "requests are counted per API key over a sliding 60-second window; exceeding it returns HTTP 429 with a "
    "Retry-After header.",
    "tokens expire after one hour and must be refreshed with the refresh endpoint; revoked tokens fail immediately.",
    "clients should retry idempotent calls with exponential backoff and jitter, at most five times.",
    "exports run asynchronously; poll the job URL until its status is 'done', then download the file.",
    "each delivery carries an HMAC-SHA256 signature of the raw body in the X-Signature header.",
]
FOLLOW_UPS = [
    "Thanks, that helps.",
    "Great, one more thing.",
    "Perfect. Different question now.",
    "OK, understood. Next topic.",
]


def tool_schemas(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The tools (all, or those named) in OpenAI function-calling format (``apply_chat_template(tools=...)``)."""
    schemas = []
    for tool in TOOLS:
        if names is not None and tool["name"] not in names:
            continue
        properties = {name: {"type": kind, "description": doc} for name, (kind, doc) in tool["parameters"].items()}
        schemas.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": {"type": "object", "properties": properties, "required": tool["required"]},
                },
            }
        )
    return schemas


def _task(rng: random.Random) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """(user request, goal phrase, planned tool calls) of one user turn."""
    kind = rng.choice(["weather", "stocks", "sql", "code", "docs"])
    if kind == "weather":
        cities = rng.sample(CITIES, 2)
        calls = [("get_weather", {"city": c, "units": "metric"}) for c in cities]
        request = (
            f"I'm choosing between {cities[0]} and {cities[1]} for a three-day trip starting tomorrow. "
            "Which one will have better weather, and what should I pack?"
        )
        return request, f"which of {cities[0]} and {cities[1]} has the better forecast", calls
    if kind == "stocks":
        tickers = rng.sample(sorted(TICKERS), 2)
        shares = rng.randint(10, 400)
        calls = [("get_stock_price", {"ticker": t}) for t in tickers]
        # the prices are filled in from the two lookups' results ({0}, {1}) when the trajectory is generated
        calls.append(("calculator", {"expression": f"{shares} * {{0}} - {shares} * {{1}}"}))
        request = (
            f"I hold {shares} shares of {TICKERS[tickers[0]]} ({tickers[0]}) and I'm thinking of swapping "
            f"them for the same number of {tickers[1]}. What's the value difference right now?"
        )
        return request, f"the value difference between {shares} shares of {tickers[0]} and {tickers[1]}", calls
    if kind == "sql":
        table = rng.choice(sorted(TABLES))
        column = rng.choice(TABLES[table][1:])
        days = rng.choice([7, 14, 30, 90])
        query = f"SELECT {column}, COUNT(*) AS n FROM {table} GROUP BY {column} ORDER BY n DESC"
        calls = [("run_sql", {"query": query, "limit": 5})]
        if rng.random() < 0.6:
            calls.append(
                (
                    "run_sql",
                    {
                        "query": f"SELECT COUNT(*) FROM {table} WHERE created_at > now() - interval '{days} days'",
                        "limit": 1,
                    },
                )
            )
        request = (
            f"Can you pull a quick breakdown of the {table} table by {column}? Also tell me how much of it "
            f"is from the last {days} days."
        )
        return request, f"the distribution of {table} by {column}", calls
    if kind == "code":
        paths = rng.sample(FILES, 2)
        calls = [("read_file", {"path": p}) for p in paths]
        request = (
            f"The server keeps timing out under load since yesterday's deploy. Can you look at {paths[0]} "
            "and tell me what's wrong?"
        )
        return request, "why the server times out after the deploy", calls
    topic = rng.choice(TOPICS)
    calls = [("search_docs", {"query": topic, "top_k": 3})]
    request = f"How do {topic} work in your API? I need to explain it to my team today."
    return request, f"how {topic} work", calls


def _evaluate(expression: str) -> float:
    """Exact value of an arithmetic expression of numbers, + - * / and parentheses (no eval)."""
    operators = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


def _tool_result(rng: random.Random, name: str, arguments: dict[str, Any]) -> str:
    if name == "get_weather":
        highs = [rng.randint(-5, 33) for _ in range(3)]
        days = [
            {
                "day": d,
                "high_c": high,
                "low_c": high - rng.randint(3, 12),
                "rain_mm": round(rng.uniform(0, 18), 1),
                "summary": rng.choice(["sunny", "partly cloudy", "showers", "overcast", "windy", "thunderstorms"]),
            }
            for d, high in zip(("tomorrow", "day 2", "day 3"), highs)
        ]
        return json.dumps({"city": arguments["city"], "now_c": rng.randint(-5, 30), "forecast": days})
    if name == "get_stock_price":
        price = round(rng.uniform(8, 900), 2)
        return json.dumps(
            {
                "ticker": arguments["ticker"],
                "price": price,
                "change_pct": round(rng.uniform(-6, 6), 2),
                "volume": rng.randint(10_000, 9_000_000),
                "currency": "USD",
            }
        )
    if name == "calculator":
        return json.dumps(
            {"expression": arguments["expression"], "result": round(_evaluate(arguments["expression"]), 2)}
        )
    if name == "run_sql":
        rows = [
            [rng.choice(["EU", "US", "APAC", "open", "closed", "high", "low", "pending"]), rng.randint(3, 5000)]
            for _ in range(rng.randint(1, arguments["limit"]))
        ]
        return json.dumps({"columns": ["value", "n"], "rows": rows, "elapsed_ms": rng.randint(8, 900)})
    if name == "read_file":
        timeout = rng.choice([1, 2, 5, 30])
        workers = rng.choice([1, 2, 4, 16])
        lines = [
            f"# {arguments['path']}",
            "import os",
            "",
            f"REQUEST_TIMEOUT_S = {timeout}",
            f"WORKERS = int(os.environ.get('WORKERS', {workers}))",
            f"POOL_SIZE = {rng.choice([2, 5, 10, 50])}  # database connections",
            "RETRY_BACKOFF = " + rng.choice(["None", "[0.1, 0.5, 2.0]", "'exponential'"]),
        ]
        return "\n".join(lines)
    passages = rng.sample(DOC_PASSAGES, arguments["top_k"])
    return "\n".join(f"[{i + 1}] {arguments['query'].capitalize()}: {text}" for i, text in enumerate(passages))


def _reasoning(rng: random.Random, goal: str, tool: str | None) -> str:
    sentences = [rng.choice(REASONING_OPENERS).format(goal=goal)]
    if tool is None:
        sentences += rng.sample(CONCLUSION_STEPS, rng.randint(2, 3))
    else:
        sentences += [s.format(tool=tool) for s in rng.sample(REASONING_STEPS, rng.randint(2, 4))]
        sentences.append(f"I'll call {tool} now.")
    return " ".join(sentences)


def _summary(name: str, result: str) -> str:
    """One sentence stating what a tool returned (answers cite the tool results, never invented figures)."""
    if name == "get_weather":
        data = json.loads(result)
        days = "; ".join(f"{d['day']} {d['low_c']} to {d['high_c']} C, {d['summary']}" for d in data["forecast"])
        return f"{data['city']}: {days}."
    if name == "get_stock_price":
        data = json.loads(result)
        return f"{data['ticker']} trades at {data['price']} {data['currency']} ({data['change_pct']:+}% today)."
    if name == "calculator":
        data = json.loads(result)
        return f"The difference works out to {data['result']} USD ({data['expression']})."
    if name == "run_sql":
        data = json.loads(result)
        top = ", ".join(f"{value}: {n}" for value, n in data["rows"])
        return f"The query returned {len(data['rows'])} rows ({top})."
    if name == "read_file":
        lines = [line for line in result.splitlines() if "=" in line]
        return f"{result.splitlines()[0][2:]} sets " + ", ".join(line.split("#")[0].strip() for line in lines) + "."
    return "The documentation says: " + result.splitlines()[0].split(": ", 1)[1]


def _answer(rng: random.Random, goal: str, summaries: list[str]) -> str:
    closing = rng.choice(
        [
            "My recommendation is to act on this now rather than wait, since these figures can change during the day.",
            "If you want, I can dig into the details or set up a recurring check.",
            "Let me know if you want the raw numbers exported or a chart of them.",
            "The main caveat is that these are live values; I would re-check them before any decision.",
        ]
    )
    return " ".join([f"Here is what I found about {goal}.", *summaries, closing])


def _user_turn(rng: random.Random, request: str, goal: str, calls, max_tool_steps: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": request}]
    summaries, prices = [], []
    for name, arguments in calls[:max_tool_steps]:
        if name == "calculator":
            arguments = {"expression": arguments["expression"].format(*prices)}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": _reasoning(rng, goal, name),
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}],
            }
        )
        result = _tool_result(rng, name, arguments)
        summaries.append(_summary(name, result))
        if name == "get_stock_price":
            prices.append(json.loads(result)["price"])
        messages.append({"role": "tool", "content": result})
    messages.append(
        {
            "role": "assistant",
            "content": _answer(rng, goal, summaries),
            "reasoning_content": _reasoning(rng, goal, None),
        }
    )
    return messages


def generate_agent_conversation(rng: random.Random, max_user_turns: int = 3, max_tool_steps: int = 3) -> dict:
    """One trajectory: ``{"messages": [...], "tools": json text}``.

    The trajectory is offered the tools it uses plus one it does not (as agents are usually given a task's
    toolset, not every tool there is), which keeps the system prompt at a realistic length.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    for turn in range(rng.randint(1, max_user_turns)):
        request, goal, calls = _task(rng)
        if turn > 0:
            request = rng.choice(FOLLOW_UPS) + " " + request
        messages += _user_turn(rng, request, goal, calls, rng.randint(1, max_tool_steps))
    # One schema for every message (Arrow needs it): absent fields are None, as datasets would store them.
    for message in messages:
        message.setdefault("reasoning_content", None)
        message.setdefault("tool_calls", None)
    used = {call["function"]["name"] for m in messages for call in m["tool_calls"] or []}
    unused = sorted(t["name"] for t in TOOLS if t["name"] not in used)
    offered = used | ({rng.choice(unused)} if unused else set())
    return {"messages": messages, "tools": json.dumps(tool_schemas(sorted(offered)))}


def synthetic_agent_dataset(
    num_conversations: int = 64, seed: int = 0, max_user_turns: int = 3, max_tool_steps: int = 3
) -> datasets.Dataset:
    """``num_conversations`` trajectories (``messages`` and ``tools`` columns), deterministic in ``seed``.

    Args:
        num_conversations: rows.
        seed: seeds the only random generator used.
        max_user_turns: user requests per trajectory are drawn from ``1..max_user_turns``.
        max_tool_steps: tool calls per user request are drawn from ``1..max_tool_steps`` (each an assistant
            message with reasoning and a tool call, then the tool's result), before the final answer.
    """
    for name, value in (
        ("num_conversations", num_conversations),
        ("max_user_turns", max_user_turns),
        ("max_tool_steps", max_tool_steps),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    rng = random.Random(seed)
    rows = [generate_agent_conversation(rng, max_user_turns, max_tool_steps) for _ in range(num_conversations)]
    return datasets.Dataset.from_list(rows)
