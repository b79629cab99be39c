"""The one answer of the soak that differed from the store-off server (client 3, turn 5, a hit),
recomputed in process without any fault: the hit's and a cold prefill's logits, and the top-2
margin of each greedy step. Run: HF_HUB_OFFLINE=1 python docs/results/soak/tie_check.py"""
import tempfile

import torch

from kvstrata.hf.cache import CompressedCache
from kvstrata.hf.run import forward
from kvstrata.models import load
from kvstrata.place import KVStore, StoreConfig
from kvstrata.place.prefix_server import PrefixServer
from kvstrata_lab.serve_bench.agents import Scripts
from kvstrata_lab.serve_bench.soak import SoakConfig

torch.set_num_threads(2)
lc = SoakConfig().load
model, tok = load(lc.model)
print("dtype", model.dtype)
s = Scripts(tok, lc.context, lc.turns, lc.tool_tokens, lc.seed).script(3, 0)
answers = ['The paragraph mentioning "allowing" is the one that discusses the "allowing',
 'The paragraph discusses the "allowing" of a function to accept a variable number',
 'The document does contradict itself about accessed. The document discusses the "allowing"',
 'The document does contradict itself about accessed. The document discusses the "allowing"']
msgs = [{"role": "system", "content": s.system}]
prompts = []
for t in range(5):
    msgs.append({"role": "user", "content": s.turns[t]})
    prompts.append(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids)
    if t < 4: msgs.append({"role": "assistant", "content": answers[t]})
server = PrefixServer(model, KVStore.from_config(StoreConfig(root=tempfile.mkdtemp())), "bf16", block_size=256)
for p in prompts:
    served = server.serve(p)
    print(served.kind, len(p), served.reused_tokens)
hit = served.logits[0].float()
cache = CompressedCache(model.config, "bf16")
cold = forward(model, torch.tensor([prompts[-1]]), cache)[0, -1].float()
lp_h, lp_c = hit.log_softmax(-1), cold.log_softmax(-1)
kl = (lp_c.exp() * (lp_c - lp_h)).sum()
top_h, top_c = hit.topk(3), cold.topk(3)
print("KL", kl.item(), "max|dlogit|", (hit - cold).abs().max().item())
print("hit top", [tok.decode([i]) for i in top_h.indices], top_h.values.tolist())
print("cold top", [tok.decode([i]) for i in top_c.indices], top_c.values.tolist())
def run(logits, cache, n=12):
    out = []
    for _ in range(n):
        top = logits.topk(2)
        out.append((tok.decode([int(top.indices[0])]), round(float(top.values[0] - top.values[1]), 3)))
        logits = forward(model, top.indices[:1].view(1, 1), cache)[0, -1].float()
    return out
print("hit ", run(hit, served.cache))
print("cold", run(cold, cache))
