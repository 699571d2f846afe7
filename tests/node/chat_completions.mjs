// The official openai-node SDK's Chat Completions and models list, unmodified, against a
// running gateway: `node tests/node/chat_completions.mjs SCENARIO BASE_URL API_KEY`.
// Scenarios: stream (models.list, a whole completion, then a stream with usage), tools (a
// streamed tool call, its output sent back as a tool message, the answer). Prints one JSON
// object on its last line; exits non-zero on an error. Needs `npm ci` in tests/node first.
import OpenAI from 'openai';

const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string' } } },
  },
};

async function stream(client) {
  const models = [];
  for await (const model of client.models.list()) models.push(model.id);
  const user = [{ role: 'user', content: 'What is the capital of France?' }];
  const whole = await client.chat.completions.create({ model: models[0], messages: user });
  const chunks = await client.chat.completions.create({
    model: models[0], messages: user, stream: true, stream_options: { include_usage: true },
  });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of chunks) {
    for (const choice of chunk.choices) {
      text += choice.delta.content ?? '';
      finish = choice.finish_reason ?? finish;
    }
    usage = chunk.usage ?? usage;
  }
  return {
    models,
    whole: whole.choices[0].message.content,
    whole_finish: whole.choices[0].finish_reason,
    text,
    finish,
    usage,
  };
}

async function tools(client) {
  const model = (await client.models.list()).data[0].id;
  const messages = [{ role: 'user', content: 'Please call get_weather for Seoul.' }];
  const runner = client.chat.completions.stream({ model, messages, tools: [WEATHER] });
  const called = await runner.finalChatCompletion();
  const message = called.choices[0].message;
  messages.push(message);
  for (const call of message.tool_calls ?? []) {
    messages.push({ role: 'tool', tool_call_id: call.id, content: 'Sunny, 21 degrees' });
  }
  const answer = await client.chat.completions.create({ model, messages, tools: [WEATHER] });
  return {
    calls: (message.tool_calls ?? []).map((c) => c.function.name),
    finish: called.choices[0].finish_reason,
    answer: answer.choices[0].message.content,
  };
}

const [scenario, baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const result = await { stream, tools }[scenario](client);
console.log(JSON.stringify(result));
