"""An oracle drafter: heads that know the target's own greedy future, for testing that a
decoder accepts everything it should (accepted length k + 1 per step)."""
import torch


class OracleDrafter:
    def __init__(self, model, prompt_ids, continuation, *, num_heads, vocab_size):
        self.num_heads = num_heads
        self.vocab_size = vocab_size
        self.temperatures = torch.ones(num_heads)
        self.sequence = list(prompt_ids) + list(continuation)
        with torch.no_grad():
            out = model.model(input_ids=torch.tensor([self.sequence]))
        self.states = out.last_hidden_state[0]  # [T, d]

    def head_logits(self, hidden, root_tokens):
        rows = []
        for h in hidden:
            # The state that produced the root sits at the position just before it.
            pos = int((self.states - h).norm(dim=-1).argmin())
            logits = torch.full((self.num_heads, self.vocab_size), -10.0)
            for i in range(self.num_heads):
                target_pos = pos + i + 2
                if target_pos < len(self.sequence):
                    logits[i, self.sequence[target_pos]] = 10.0
            rows.append(logits)
        return torch.stack(rows)
