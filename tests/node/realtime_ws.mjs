// The official openai-node SDK's Realtime client (OpenAIRealtimeWS), unmodified, against a
// running gateway: `node tests/node/realtime_ws.mjs SCENARIO BASE_URL API_KEY`. The client
// always dials wss:// (whatever BASE_URL's scheme), so the gateway must serve TLS; Node
// trusts its certificate through NODE_EXTRA_CA_CERTS. Scenarios: stream (one answer),
// cancel (response.cancel mid-answer, then a next turn), tools (a function call, its output,
// the answer to it). Prints one JSON object on its last line; exits non-zero on an error.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const WEATHER = {
  type: 'function',
  name: 'get_weather',
  description: 'The weather in a city.',
  parameters: { type: 'object', properties: { city: { type: 'string' } } },
};

const user = (text) => ({ type: 'message', role: 'user', content: [{ type: 'input_text', text }] });

/** The next event of `type` (an error event rejects). */
function next(rt, type) {
  return new Promise((resolve, reject) => {
    const onEvent = (event) => {
      if (event.type === 'error') {
        rt.off('event', onEvent);
        reject(new Error(JSON.stringify(event.error)));
      } else if (event.type === type) {
        rt.off('event', onEvent);
        resolve(event);
      }
    };
    rt.on('event', onEvent);
  });
}

/** Ask for a response (with `params`, if given); gather its deltas until response.done
 * (`onDelta` sees each). */
function respond(rt, onDelta = () => {}, params = null) {
  return new Promise((resolve, reject) => {
    let deltas = '';
    const onEvent = (event) => {
      if (event.type === 'error') {
        rt.off('event', onEvent);
        reject(new Error(JSON.stringify(event.error)));
      }
      if (event.type === 'response.output_text.delta') {
        deltas += event.delta;
        onDelta(event);
      }
      if (event.type === 'response.done') {
        rt.off('event', onEvent);
        resolve({ deltas, response: event.response });
      }
    };
    rt.on('event', onEvent);
    rt.send(params ? { type: 'response.create', response: params } : { type: 'response.create' });
  });
}

function summary({ deltas, response }) {
  const message = response.output.find((item) => item.type === 'message');
  return {
    status: response.status,
    reason: response.status_details?.reason ?? null,
    deltas,
    text: message?.content?.[0]?.text ?? null,
    calls: response.output
      .filter((item) => item.type === 'function_call')
      .map((item) => ({ name: item.name, arguments: item.arguments, call_id: item.call_id })),
  };
}

async function stream(rt) {
  rt.send({ type: 'conversation.item.create', item: user('Hello over TLS!') });
  return { turns: [summary(await respond(rt))] };
}

async function cancel(rt) {
  rt.send({ type: 'conversation.item.create', item: user('Tell me a long story.') });
  let sent = false;
  const cut = await respond(rt, (event) => {
    if (!sent) {
      sent = true;
      rt.send({ type: 'response.cancel', response_id: event.response_id });
    }
  });
  rt.send({ type: 'conversation.item.create', item: user('And now a short one.') });
  // Short: the engine's answers are long enough for the cancel to land mid-answer.
  const next = await respond(rt, () => {}, { max_output_tokens: 20 });
  return { turns: [summary(cut), summary(next)] };
}

async function tools(rt) {
  rt.send({ type: 'session.update', session: { type: 'realtime', tools: [WEATHER] } });
  await next(rt, 'session.updated');
  rt.send({ type: 'conversation.item.create', item: user('Use get_weather for Paris.') });
  const call = summary(await respond(rt));
  const [first] = call.calls;
  rt.send({
    type: 'conversation.item.create',
    item: { type: 'function_call_output', call_id: first.call_id, output: 'Sunny' },
  });
  return { turns: [call, summary(await respond(rt))] };
}

const SCENARIOS = { stream, cancel, tools };

async function main() {
  const [scenario, baseURL, apiKey] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey });
  const rt = new OpenAIRealtimeWS({ model: 'gpt-realtime' }, client);
  const errors = [];
  rt.on('error', (err) => errors.push(String(err?.message ?? err)));
  const created = await next(rt, 'session.created');
  const result = await SCENARIOS[scenario](rt);
  rt.close();
  console.log(JSON.stringify({ url: rt.url.toString(), created: created.type, errors, ...result }));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
