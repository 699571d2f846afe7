// The Vercel AI SDK (`ai`, `@ai-sdk/openai`), unmodified, against running gateways:
// `node structured.mjs API_KEY MODEL BASE_URL...`. generateObject on the provider's Responses
// model and its Chat Completions model, and streamObject on the Chat model, each with a zod
// schema. Prints one JSON object on its last line: the schema as JSON, and for each gateway
// each object.
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, streamObject } from "ai";
import { z } from "zod";

const [apiKey, model, ...baseURLs] = process.argv.slice(2);

// Bounded, so that a small model's answer stays short; `motto` is optional as nullable.
const City = z.object({
  name: z.string().max(20).describe("The city's name"),
  kind: z.enum(["capital", "town"]),
  landmarks: z.array(z.string().max(30)).max(1),
  motto: z.string().max(30).nullable(),
});
const prompt = "Describe Paris, the capital of France, with one landmark.";

async function objects(baseURL) {
  const provider = createOpenAI({ baseURL, apiKey });
  const streaming = async () => {
    const stream = streamObject({ model: provider.chat(model), schema: City, prompt });
    let partials = 0;
    for await (const _ of stream.partialObjectStream) partials += 1;
    return { streamed: await stream.object, partials };
  };
  const [responses, chat, { streamed, partials }] = await Promise.all([
    generateObject({ model: provider.responses(model), schema: City, prompt }),
    generateObject({ model: provider.chat(model), schema: City, prompt }),
    streaming(),
  ]);
  return { responses: responses.object, chat: chat.object, streamed, partials, finish: chat.finishReason };
}

const gateways = [];
for (const baseURL of baseURLs) gateways.push(await objects(baseURL));
console.log(JSON.stringify({ schema: z.toJSONSchema(City), gateways }));
