// The official openai-node SDK's Responses WebSocket client (ResponsesWS), unmodified,
// against a running gateway: `node tests/node/responses_ws.mjs SCENARIO BASE_URL API_KEY`,
// BASE_URL like http://127.0.0.1:PORT/v1 (ResponsesWS dials ws://.../v1/responses).
// Scenarios: stream (one answer), chain (two turns by previous_response_id, the second
// sending only its new input), tools (a function call, then its output chained), cancel
// (the WebSocket has no cancel event in this SDK, so: a background response over HTTP,
// then client.responses.cancel). Prints one JSON object on its last line; exits non-zero
// on an error. Needs `npm ci` in tests/node first.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const MODEL = process.env.RESPONSES_MODEL ?? 'gpt-4.1-mini';
const TERMINAL = new Set(['response.completed', 'response.incomplete', 'response.failed']);
const WEATHER = {
  type: 'function',
  name: 'get_weather',
  description: 'The weather in a city.',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
};

const user = (text) => [{ type: 'message', role: 'user', content: [{ type: 'input_text', text }] }];

function outputText(response) {
  return (response?.output ?? [])
    .filter((item) => item.type === 'message')
    .flatMap((item) => item.content.filter((c) => c.type === 'output_text').map((c) => c.text))
    .join('');
}

/** Send one response.create and gather its events until a terminal event or an error. */
function turn(ws, body) {
  return new Promise((resolve) => {
    const seen = { types: [], seqs: [], deltas: '', arguments: '', response: null, error: null };
    const onEvent = (event) => {
      seen.types.push(event.type);
      if (Number.isInteger(event.sequence_number)) seen.seqs.push(event.sequence_number);
      if (event.type === 'response.output_text.delta') seen.deltas += event.delta;
      if (event.type === 'response.function_call_arguments.delta') seen.arguments += event.delta;
      if (event.type === 'error') seen.error = event;
      if (TERMINAL.has(event.type)) seen.response = event.response;
      if (seen.error || seen.response) {
        ws.off('event', onEvent);
        resolve(report(seen));
      }
    };
    ws.on('event', onEvent);
    ws.send({ type: 'response.create', model: MODEL, ...body });
  });
}

function report(seen) {
  const r = seen.response;
  const { seqs } = seen;
  return {
    id: r?.id ?? null,
    status: r?.status ?? null,
    previous_response_id: r?.previous_response_id ?? null,
    deltas: seen.deltas,
    text: outputText(r),
    arguments: seen.arguments,
    calls: (r?.output ?? [])
      .filter((i) => i.type === 'function_call')
      .map((i) => ({ name: i.name, arguments: i.arguments, call_id: i.call_id })),
    types: seen.types,
    contiguous: seqs.length > 0 && seqs.every((s, n) => s === seqs[0] + n),
    error: seen.error,
  };
}

async function stream(ws) {
  return { turns: [await turn(ws, { input: user('Hello!') })] };
}

async function chain(ws) {
  const first = await turn(ws, { input: user('Hello! My name is Ada.') });
  const second = await turn(ws, { input: user('What is my name?'), previous_response_id: first.id });
  return { turns: [first, second] };
}

async function tools(ws) {
  const first = await turn(ws, { input: user('Use get_weather: what is the weather in Paris?'), tools: [WEATHER] });
  if (!first.calls.length) throw new Error(`no function call: ${JSON.stringify(first)}`);
  const output = { type: 'function_call_output', call_id: first.calls[0].call_id, output: 'Sunny' };
  const second = await turn(ws, {
    input: [output],
    previous_response_id: first.id,
    tools: [WEATHER],
  });
  return { turns: [first, second] };
}

async function cancel(_ws, client) {
  const started = await client.responses.create({
    model: MODEL,
    input: user('Tell me a very long story.'),
    background: true,
  });
  const cancelled = await client.responses.cancel(started.id);
  const after = await client.responses.retrieve(started.id);
  return {
    via: 'http',
    id: started.id,
    started: started.status,
    cancelled: cancelled.status,
    retrieved: after.status,
  };
}

const SCENARIOS = { stream, chain, tools, cancel };

async function main([scenario, baseURL, apiKey]) {
  const run = SCENARIOS[scenario];
  if (!run) throw new Error(`unknown scenario ${scenario}`);
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  const ws = new ResponsesWS(client);
  const errors = [];
  ws.on('error', (err) => errors.push(err.error ?? { message: err.message }));
  const closed = new Promise((resolve) => ws.on('close', (code) => resolve(code)));
  const timer = setTimeout(() => {
    console.error('timed out');
    process.exit(2);
  }, 60_000);
  const out = await run(ws, client);
  ws.close({ code: 1000, reason: 'done' });
  const closeCode = await closed;
  clearTimeout(timer);
  console.log(JSON.stringify({ scenario, url: ws.url.toString(), ...out, errors, closeCode }));
}

main(process.argv.slice(2)).catch((err) => {
  console.error(err);
  process.exit(1);
});
