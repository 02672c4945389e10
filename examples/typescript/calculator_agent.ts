// The calculator tool agent (rollout/agents/calculator.py) in TypeScript, with the official
// `openai` package: run once per attempt by the agent runner's command,
//
//   [agents]
//   command = ["examples/typescript/node_modules/.bin/tsx", "examples/typescript/calculator_agent.ts"]
//
// (`npm ci --prefix examples/typescript` first; `make test` does). The runner's contract
// (docs/agents.md): the task as JSON on stdin; SF_GATEWAY_URL, SF_GATEWAY_KEY, SF_SESSION_ID,
// SF_MODEL, SF_TEMPERATURE, SF_MAX_TOKENS in the environment; the answer is the last line of
// stdout; exit 75 when the gateway is down (the task is retried). The only changes from an agent
// written against OpenAI are the base URL, the key and the header naming the session.
//
// It offers the `calculator` function, runs each call the model makes, sends the result back as
// a `tool` message and lets the model go on, for at most the task's max_turns model calls.

import OpenAI from "openai";
import type {
  ChatCompletionMessageParam,
  ChatCompletionTool,
} from "openai/resources/chat/completions";

const EX_TEMPFAIL = 75;

// The same schema, key for key, as rollout.agents.calculator.TOOL: the prompt is then the same.
const TOOL: ChatCompletionTool = {
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression such as 2+3 or (4*5)-1.",
    parameters: {
      type: "object",
      properties: { expression: { type: "string" } },
      required: ["expression"],
    },
  },
};

interface Task {
  messages: { role: "system" | "user" | "assistant"; content: string | null }[];
  max_turns: number;
  metadata: Record<string, string>;
}

// Arithmetic on numbers, + - * / and parentheses, by recursive descent (no eval): the value as
// text (an integer when whole), or "error: ..." for the model to read.
export function calculate(expression: string): string {
  const tokens = expression.match(/\d+(?:\.\d+)?|[-+*/()]|\S/g) ?? [];
  let at = 0;
  const peek = () => tokens[at];
  const take = () => tokens[at++];
  function primary(): number {
    const token = take();
    if (token === "-") return -primary();
    if (token === "+") return primary();
    if (token === "(") {
      const value = sum();
      if (take() !== ")") throw new Error("missing )");
      return value;
    }
    if (token !== undefined && /^\d/.test(token)) return Number(token);
    throw new Error(`unexpected ${token ?? "end"}`);
  }
  function product(): number {
    let value = primary();
    while (peek() === "*" || peek() === "/") {
      if (take() === "*") value *= primary();
      else {
        const divisor = primary();
        if (divisor === 0) throw new Error("division by zero");
        value /= divisor;
      }
    }
    return value;
  }
  function sum(): number {
    let value = product();
    while (peek() === "+" || peek() === "-") value = take() === "+" ? value + product() : value - product();
    return value;
  }
  try {
    const value = sum();
    if (at !== tokens.length) throw new Error(`unexpected ${peek()}`);
    return String(value);
  } catch (error) {
    return `error: ${(error as Error).message}`;
  }
}

function runTool(args: string): string {
  try {
    const parsed = JSON.parse(args);
    if (typeof parsed?.expression !== "string") return 'error: arguments must be {"expression": "<text>"}';
    return calculate(parsed.expression);
  } catch (error) {
    return `error: arguments are not JSON: ${(error as Error).message}`;
  }
}

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString("utf8");
}

async function main(): Promise<void> {
  const task: Task = JSON.parse(await readStdin());
  const client = new OpenAI({
    baseURL: process.env.SF_GATEWAY_URL,
    apiKey: process.env.SF_GATEWAY_KEY ?? "unused",
    defaultHeaders: { "X-Session-Id": process.env.SF_SESSION_ID ?? "" },
    maxRetries: 0,
  });
  const messages: ChatCompletionMessageParam[] = task.messages.map((m) => ({
    role: m.role,
    content: m.content ?? "",
  })) as ChatCompletionMessageParam[];
  const offered = task.metadata?.tools !== "none";
  for (let turn = 1; ; turn++) {
    const reply = await client.chat.completions.create({
      model: process.env.SF_MODEL ?? "policy",
      messages,
      temperature: Number(process.env.SF_TEMPERATURE ?? "1"),
      max_tokens: Number(task.metadata?.max_tokens ?? process.env.SF_MAX_TOKENS ?? "48"),
      ...(offered ? { tools: [TOOL] } : {}),
    });
    const message = reply.choices[0].message;
    const calls = message.tool_calls ?? [];
    if (calls.length === 0 || turn >= task.max_turns) {
      console.log((message.content ?? "").replaceAll("\n", " "));
      return;
    }
    messages.push({ role: "assistant", content: message.content, tool_calls: calls });
    for (const call of calls) {
      if (call.type !== "function") continue;
      messages.push({ role: "tool", tool_call_id: call.id, content: runTool(call.function.arguments) });
    }
  }
}

main().catch((error) => {
  const status = error instanceof OpenAI.APIError ? error.status : undefined;
  console.error(error);
  const down = error instanceof OpenAI.APIConnectionError || [502, 503, 504].includes(status ?? 0);
  process.exit(down ? EX_TEMPFAIL : 1);
});
