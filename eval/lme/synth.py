"""`memexrl lme synth`: a small LME-V2 data set in the real schema (lme-v2.md "Data layout").

Web-agent trajectories over the invented environments of eval/lme/synth_world.py (ShopNova Admin
and TaskHive: `web`; PeopleDesk: `enterprise`) and questions of all seven types whose answers are
true in them. Each answer's evidence is planted sparsely, in 1-2 trajectories among distractors:

- static(-abs): an entity's detail page, visited on a detour inside an unrelated trajectory;
- dynamic: one trajectory shows the old value, a LATER one edits it (the later one wins);
  dynamic-abs: one edit, and the question names a value it was never set to;
- procedure: the clicks of a successful form procedure; procedure-abs: a page shown on a detour
  that lacks the button the question assumes;
- errors-gotchas: a form rejects a value with an error, the agent fixes it and succeeds.

Entities that questions ask about appear only in their evidence trajectories; distractors (views,
edits, searches and browsing of other entities and pages) never touch them. Both haystacks are
ordered as the trajectories' timeline, small is a subsequence of medium, and both hold every
evidence trajectory. As in the real data a question's haystack holds its own domain only, so all
questions of a domain share one list. `synth_evidence.json` (question id -> evidence trajectories,
states and the strings planted there) is for tests and debugging; the loader ignores it.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import MemexError
from eval.lme.data import QUESTION_TYPES
from eval.lme.synth_world import (
    ENVS,
    Env,
    TrajectoryBuilder,
    detail_content,
    form_content,
    home_content,
    list_content,
    section_content,
    write_png,
)

MAX_PER_TYPE = 6  # each environment has two procedures, two gotchas and two missing features
EVIDENCE_FILE = "synth_evidence.json"
ABBR = dict(zip(QUESTION_TYPES, ("static", "static-abs", "dynamic", "dynamic-abs", "procedure", "procedure-abs",
                                 "gotchas")))


@dataclass
class Spec:
    """One planned trajectory: a flow of `kind` in `env`, with detours (static facts, pages) before it."""

    env: Env
    kind: str  # view | edit | procedure | gotcha | browse | search_miss
    tier: str  # evidence | small | medium
    args: dict = field(default_factory=dict)
    detours: list[dict] = field(default_factory=list)
    tid: str = ""


def _distinct(env: Env, attr: str, rng: random.Random, k: int, exclude: tuple[str, ...] = ()) -> list[str]:
    """k distinct values of `attr` (from its generator) not in `exclude`."""
    out: list[str] = []
    for _ in range(1000):
        v = env.attrs[attr](rng)
        if v not in out and v not in exclude:
            out.append(v)
        if len(out) == k:
            return out
    raise AssertionError(f"{env.slug}.{attr} has fewer than {k} values")


def _options(rng: random.Random, right: list[str], wrong: list[str]) -> tuple[str, str]:
    """('A) ..\\nB) ..', gold letters 'A, C') for the shuffled options."""
    opts = right + wrong
    rng.shuffle(opts)
    letters = "ABCDEFGH"
    text = "\n".join(f"{letters[i]}) {o}" for i, o in enumerate(opts))
    return text, ", ".join(letters[i] for i, o in enumerate(opts) if o in right)


def _fmt(value, values: dict):
    return value.format(**values) if isinstance(value, str) else value


def plan_question(qtype: str, i: int, env: Env, ents: list[dict], rng: random.Random, specs: list[Spec],
                  detours: list[tuple[Env, dict]]) -> dict:
    """The question record (without image) and its planned evidence (appended to specs / detours)."""
    qid = f"synth-{ABBR[qtype]}-{i:02d}"
    variant, j = i % 3, (i // 3) % 2
    app, kind = env.app, env.kind
    q = {"id": qid, "domain": env.domain, "question": "", "image": None, "answer": "", "eval_function": "",
         "question_type": qtype}
    if qtype == "static-environment":
        e = ents.pop()
        a1, a2 = env.static_attrs
        if variant == 0:
            q.update(question=f"In {app}, what is the {a1} of the {kind} shown in the attached screenshot?",
                     answer=e[a1], eval_function="norm_phrase_set_match", image_text=e["name"])
            needles = [e[a1]]
        elif variant == 1:
            q.update(question=f"In {app}, what are the {a1} and the {a2} of the {kind} '{e['name']}'? "
                     f"Answer as '{a1} / {a2}'.", answer=f"{e[a1]} / {e[a2]}",
                     eval_function="norm_phrase_set_match|separators=/")
            needles = [e[a1], e[a2]]
        else:
            text, gold = _options(rng, [e[env.mc_attr]], _distinct(env, env.mc_attr, rng, 3, (e[env.mc_attr],)))
            q.update(question=f"In {app}, what is the {env.mc_attr} of the {kind} '{e['name']}'?\n{text}",
                     answer=gold, eval_function="mc_choice_match")
            needles = [e[env.mc_attr]]
        detours.append((env, {"qid": qid, "entity": e, "needles": needles}))
    elif qtype == "static-environment-abs":
        e = ents.pop()
        a1, g = env.static_attrs[0], env.group_attr
        wrong = _distinct(env, g, rng, 1, (e[g],))[0]
        q.update(question=f"In {app}, what is the {a1} of the {kind} '{e['name']}' in the {wrong} {g.lower()}?",
                 answer=f"The premise is wrong: '{e['name']}' is in the {e[g]} {g.lower()}, not {wrong}. "
                 f"(Its {a1} is {e[a1]}.)", eval_function="llm_abstention_checker")
        detours.append((env, {"qid": qid, "entity": e, "needles": [e[g], e[a1]]}))
    elif qtype == "dynamic-environment":
        e = ents.pop()
        a = env.dyn_attr
        v1, v2 = e[a], _distinct(env, a, rng, 1, (e[a],))[0]
        before = Spec(env, "view", "evidence", {"entity": e, "ask": env.static_attrs[1], "qid": qid, "needles": [v1]})
        after = Spec(env, "edit", "evidence", {"entity": e, "attr": a, "new": v2, "qid": qid})
        after.args["after"] = before
        specs += [before, after]
        if variant == 0:
            q.update(question=f"In {app}, what is the current {a} of the {kind} '{e['name']}'?", answer=v2,
                     eval_function="norm_phrase_set_match")
        elif variant == 1:
            text, gold = _options(rng, [v2], [v1, *_distinct(env, a, rng, 2, (v1, v2))])
            q.update(question=f"In {app}, what is the {a} of the {kind} '{e['name']}' now?\n{text}", answer=gold,
                     eval_function="mc_choice_match")
        else:
            q.update(question=f"In {app}, what was the {a} of the {kind} '{e['name']}' when first seen, and what "
                     "is it now? Answer as 'before; now'.", answer=f"{v1}; {v2}",
                     eval_function="norm_phrase_set_match_ordered")
    elif qtype == "dynamic-environment-abs":
        e = ents.pop()
        a = env.dyn_attr
        v1 = e[a]
        v2, fake = _distinct(env, a, rng, 2, (v1,))
        specs.append(Spec(env, "edit", "evidence", {"entity": e, "attr": a, "new": v2, "qid": qid}))
        q.update(question=f"In {app}, what was the {a} of the {kind} '{e['name']}' before it was changed to {fake}?",
                 answer=f"The premise is wrong: the {a} of '{e['name']}' was changed from {v1} to {v2}; it was "
                 f"never set to {fake}.", eval_function="llm_abstention_checker")
    elif qtype in ("procedure", "errors-gotchas"):
        proc = env.procedures[j if qtype == "procedure" else 1 - j]
        d = rng.randint(10, 19)
        values = {"n": rng.randint(10, 99), "d": d, "e": d + 4}
        spec = Spec(env, "procedure" if qtype == "procedure" else "gotcha", "evidence",
                    {"proc": proc, "values": values, "qid": qid})
        specs.append(spec)
        q["original_goal"] = _fmt(proc["goal"], values)
        clicks = [*proc["path"], proc["submit"]]
        if qtype == "errors-gotchas":
            q.update(question=f"In {app}, what error can you run into when you {proc['task']}, and how do you get "
                     "past it?", answer=f"Saving fails with the error '{proc['error']}' when {proc['cause']}. "
                     f"Fix: {_fmt(proc['fix'], values)}.", eval_function="llm_gotchas_checker")
        elif variant == 0:
            q.update(question=f"In {app}, what do you click, in order, to {proc['task']}? List the menu items and "
                     "buttons separated by '>'.", answer=" > ".join(clicks),
                     eval_function="norm_phrase_set_match_ordered|separators=>")
        elif variant == 1:
            fields = [f[0] for f in proc["fields"]]
            text, gold = _options(rng, [f[0] for f in proc["fields"] if f[1]], [f for f in fields
                                                                               if not any(g[0] == f and g[1] for g in proc["fields"])])
            q.update(question=f"In {app}, when you {proc['task']}, which fields of the '{proc['form']}' form are "
                     f"required? Select all that apply.\n{text}", answer=gold, eval_function="mc_choice_set_match")
        else:
            q.update(question=f"In {app}, which links and buttons do you click, in order, to {proc['task']}? "
                     "Separate them with commas.", answer=", ".join(clicks),
                     eval_function="norm_phrase_set_match_ordered")
    else:  # procedure-abs
        section, page, fake, task = env.fakes[j]
        buttons = env.buttons[page]
        shown = "the attached screenshot's page" if variant == 1 else f"the {section} > {page} page"
        q.update(question=f"In {app}, how do you {task} with the '{fake}' button on {shown}?",
                 answer=f"The premise is wrong: the {section} > {page} page has no '{fake}' button; its only "
                 f"actions are {', '.join(buttons)}.", eval_function="llm_abstention_checker")
        if variant == 1:
            q["image_text"] = f"{section} > {page}"
        detours.append((env, {"qid": qid, "page": (section, page), "needles": list(buttons)}))
    return q


# ----------------------------------------------------------------------------- rendering flows

def _to_page(b: TrajectoryBuilder, section: str, page: str, thought: str, ev=None) -> None:
    """Home -> section -> (the caller adds `page`)."""
    env = b.env
    b.add("Home", env.url("home"), home_content(env, b.rng), thought, ("click", section))
    b.add(section, env.url(section), section_content(env, section), f"Open {page}.", ("click", page),
          (ev[0], [section, page]) if ev else None)


def _rows(env: Env, pool: list[dict], rng: random.Random, target: str | None = None, page: str = "") -> list[str]:
    """Rows of a list page: some distractor entities (plus `target`), or generic records on other pages."""
    if page and page != env.entity_page[1]:
        return [f"#{rng.randint(10000, 99999)}" for _ in range(rng.randint(0, 5))]
    rows = [e["name"] for e in rng.sample(pool, min(4, len(pool)))]
    if target:
        rows.insert(rng.randint(0, len(rows)), target)
    return rows


def render_detour(b: TrajectoryBuilder, d: dict, pool: list[dict]) -> None:
    env, qid = b.env, d["qid"]
    if "entity" in d:
        e = d["entity"]
        section, page = env.entity_page
        _to_page(b, section, page, f"Before the task, I look up the {env.kind} '{e['name']}' for reference.")
        b.add(page, env.url(section, page), list_content(env, page, _rows(env, pool, b.rng, e["name"])),
              f"Open '{e['name']}'.", ("click", e["name"]))
        b.add(e["name"], env.url(page, e["name"]), detail_content(env, e), "Noted; back to the task.",
              ("goto", env.url("home")), (qid, d["needles"]))
    else:
        section, page = d["page"]
        _to_page(b, section, page, f"First I take a look at {section} > {page}.")
        b.add(page, env.url(section, page), list_content(env, page, _rows(env, pool, b.rng, page=page)),
              "Nothing needed here; back to the task.",
              ("goto", env.url("home")), (qid, d["needles"]))


def render_main(b: TrajectoryBuilder, s: Spec, pool: list[dict]) -> tuple[str, str | None]:
    """The flow of `s`; returns (goal, outcome)."""
    env, rng, a = b.env, b.rng, s.args
    qid = a.get("qid")
    if s.kind in ("view", "edit"):
        e = a["entity"]
        section, page = env.entity_page
        goal = (f"Find the {a['ask']} of the {env.kind} '{e['name']}' in {env.app}." if s.kind == "view" else
                f"Change the {a['attr']} of the {env.kind} '{e['name']}' to {a['new']}.")
        _to_page(b, section, page, f"The {env.kind}s are under {section} > {page}.")
        b.add(page, env.url(section, page), list_content(env, page, _rows(env, pool, rng, e["name"])),
              f"Open '{e['name']}'.", ("click", e["name"]))
        url = env.url(page, e["name"])
        if s.kind == "view":
            b.add(e["name"], url, detail_content(env, e), f"The {a['ask']} is shown here.",
                  ("msg", f"The {a['ask']} of {e['name']} is {e[a['ask']]}."), (qid, a["needles"]) if qid else None)
            return goal, "success"
        attr, new, old = a["attr"], a["new"], e[a["attr"]]
        b.add(e["name"], url, detail_content(env, e), f"The {attr} is {old}; I edit it.", ("click", "Edit"),
              (qid, [old]) if qid else None)
        act = ("select" if env.dyn_role == "combobox" else "fill", attr, new)
        b.add(f"Edit {e['name']}", url + "/edit", form_content([(attr, True, old, env.dyn_role)], "Save"),
              f"Set the {attr} to {new}.", act)
        b.add(f"Edit {e['name']}", url + "/edit", form_content([(attr, True, new, env.dyn_role)], "Save"),
              "Save the change.", ("click", "Save"))
        e[attr] = new
        b.add(e["name"], url, detail_content(env, e, f"The {env.kind} has been saved."), "The change is saved.",
              ("msg", f"The {attr} of {e['name']} is now {new}."), (qid, [new]) if qid else None)
        return goal, "success"
    if s.kind in ("procedure", "gotcha"):
        proc, values = a["proc"], a["values"]
        section, page, button = proc["path"]
        _to_page(b, section, page, f"To {proc['task']} I go to {section} > {page}.", (qid, []))
        rows = _rows(env, pool, rng, page=page)
        b.add(page, env.url(section, page), list_content(env, page, rows), f"Click '{button}'.", ("click", button),
              (qid, [button]))
        fields = [[f[0], f[1], "", f[3] if len(f) > 3 else "textbox"] for f in proc["fields"]]
        url = env.url(section, page, "new")
        bad_field, bad = proc["bad"]
        todo = [(k, _fmt(f[2], values)) for k, f in enumerate(proc["fields"]) if f[2]]
        for n, (k, value) in enumerate(todo):
            if s.kind == "gotcha" and fields[k][0] == bad_field:
                value = _fmt(bad, values)
            act = ("select" if fields[k][3] == "combobox" else "fill", fields[k][0], value)
            b.add(proc["form"], url, form_content([tuple(f) for f in fields], proc["submit"]),
                  f"Fill in {fields[k][0]}.", act, (qid, [f[0] for f in proc["fields"] if f[1]]) if n == 0 else None)
            fields[k][2] = value
        if s.kind == "gotcha":
            b.add(proc["form"], url, form_content([tuple(f) for f in fields], proc["submit"]), "Submit the form.",
                  ("click", proc["submit"]))
            error = proc["error"]
            k = next(k for k, f in enumerate(fields) if f[0] == bad_field)
            good = _fmt(dict((f[0], f[2]) for f in proc["fields"])[bad_field], values)
            b.add(proc["form"], url, form_content([tuple(f) for f in fields], proc["submit"], f"Error: {error}"),
                  f"The form was rejected: {error} It failed because {proc['cause']}; I will "
                  f"{_fmt(proc['fix'], values)}.", ("fill", bad_field, good), (qid, [error]))
            fields[k][2] = good
        b.add(proc["form"], url, form_content([tuple(f) for f in fields], proc["submit"]), "Submit the form.",
              ("click", proc["submit"]), (qid, [proc["submit"]] + ([fields[k][2]] if s.kind == "gotcha" else [])))
        b.add(page, env.url(section, page), list_content(env, page, rows, alert=f"{proc['form']} saved successfully."),
              "It was saved.", ("msg", f"Done: {_fmt(proc['goal'], values)}."))
        return _fmt(proc["goal"], values), "success"
    if s.kind == "search_miss":
        section, page = env.entity_page
        name = a["name"]
        _to_page(b, section, page, f"I search the {env.kind}s for '{name}'.")
        b.add(page, env.url(section, page), list_content(env, page, _rows(env, pool, rng)), f"Search for '{name}'.",
              ("fill", f"Search {page}", name))
        b.add(page, env.url(section, page) + "?q=" + name.replace(" ", "+"), list_content(env, page, [], search=name),
              "No record matches.", ("msg", f"I could not find a {env.kind} named '{name}'."))
        return f"Find the {env.static_attrs[0]} of the {env.kind} '{name}'.", "failure"
    section, page = a["page"]  # browse
    rows = _rows(env, pool, rng, page=page)
    _to_page(b, section, page, f"Open {section} > {page}.")
    b.add(page, env.url(section, page), list_content(env, page, rows), "Count the records.",
          ("msg", f"The {page} page lists {len(rows)} records."))
    return f"Open {section} > {page} in {env.app} and report how many records it lists.", None


# ----------------------------------------------------------------------------- the data set

def _distractor(env: Env, tier: str, rng: random.Random, spare_names: list[str]) -> Spec:
    specials = {proc["path"][1] for proc in env.procedures} | {f[1] for f in env.fakes} | {env.entity_page[1]}
    kind = rng.choices(("view", "edit", "browse", "search_miss"), (4, 3, 2, 1))[0]
    if kind == "search_miss" and spare_names:
        return Spec(env, kind, tier, {"name": spare_names.pop()})
    if kind == "browse":
        pages = [(s, p) for s, ps in env.menu.items() for p in ps if p not in specials]
        return Spec(env, kind, tier, {"page": rng.choice(pages)})
    return Spec(env, "view" if kind == "search_miss" else kind, tier)  # entity picked when rendered


def _split(total: int, envs: tuple[Env, ...]) -> dict[str, int]:
    """`total` distractors dealt round-robin over the environments."""
    return {env.slug: total // len(envs) + (k < total % len(envs)) for k, env in enumerate(envs)}


def _plan(envs: tuple[Env, ...], seed: int, questions_per_type: int):
    """The questions and their evidence trajectories' specs (before any distractor), and the rng to go on with."""
    rng = random.Random(seed)
    pools: dict[str, list[dict]] = {}
    spare: dict[str, list[str]] = {}
    for env in envs:
        names = [f"{a} {b}" for a in env.names[0] for b in env.names[1]]
        rng.shuffle(names)
        pools[env.slug] = [env.make_entity(rng, n) for n in names[:4 * questions_per_type + 10]]
        spare[env.slug] = names[4 * questions_per_type + 10:]
    qents = {slug: pool[10:] for slug, pool in pools.items()}  # asked about; the first 10 are distractors
    questions, specs, detours = [], [], []
    for ti, qtype in enumerate(QUESTION_TYPES):
        for i in range(questions_per_type):
            env = envs[(i + ti) % len(envs)]
            questions.append(plan_question(qtype, i, env, qents[env.slug], rng, specs, detours))
    for env, d in detours:  # a detour rides on an evidence trajectory of its environment (fewest detours first)
        hosts = [s for s in specs if s.env is env]
        if not hosts:
            specs.append(_distractor(env, "evidence", rng, spare[env.slug]))
            hosts = specs[-1:]
        min(hosts, key=lambda s: (len(s.detours), rng.random())).detours.append(d)
    return rng, pools, spare, questions, specs


def _envs(domains: tuple[str, ...]) -> tuple[Env, ...]:
    """The environments of `domains`; unknown or no domains stop with one line."""
    envs = tuple(env for env in ENVS if env.domain in domains)
    if not envs or set(domains) - {env.domain for env in ENVS}:
        raise MemexError(f"domains must be among web, enterprise; got {', '.join(domains) or 'none'}")
    return envs


def evidence_trajectories(seed: int = 0, questions_per_type: int = 3,
                          domains: tuple[str, ...] = ("web", "enterprise")) -> int:
    """How many trajectories the questions' evidence takes: the smallest small haystack `write_synthetic` accepts."""
    return len(_plan(_envs(domains), seed, questions_per_type)[4])


def write_synthetic(out: Path, seed: int = 0, n_trajectories_small: int = 24, n_trajectories_medium: int = 60,
                    questions_per_type: int = 3, domains: tuple[str, ...] = ("web", "enterprise")) -> dict:
    """Write the data set under `out` (a new or earlier-synthesised directory); returns a summary dict.

    `domains=("web",)` keeps the two web environments only: then every question shares one haystack.
    """
    out = Path(out)
    envs = _envs(domains)
    if not 1 <= questions_per_type <= MAX_PER_TYPE:
        raise MemexError(f"questions per type must be 1..{MAX_PER_TYPE}, got {questions_per_type}")
    if out.exists() and any(out.iterdir()) and not (out / EVIDENCE_FILE).is_file():
        raise MemexError(f"{out} is not empty and holds no earlier synthetic set; choose a new directory")
    rng, pools, spare, questions, specs = _plan(envs, seed, questions_per_type)
    n_evidence = len(specs)
    if n_trajectories_small < n_evidence:
        raise MemexError(f"a small haystack of {n_trajectories_small} trajectories is too few: {questions_per_type} "
                         f"questions per type need {n_evidence} evidence trajectories; raise it or lower the "
                         "questions per type")
    if n_trajectories_medium < n_trajectories_small:
        raise MemexError(f"the medium haystack ({n_trajectories_medium}) must be at least the small one "
                         f"({n_trajectories_small})")
    for tier, count in (("small", n_trajectories_small - n_evidence),
                        ("medium", n_trajectories_medium - n_trajectories_small)):
        for env in envs:
            specs += [_distractor(env, tier, rng, spare[env.slug]) for _ in range(_split(count, envs)[env.slug])]
    rng.shuffle(specs)
    for s in list(specs):  # the old value is seen before the edit that changes it
        before = s.args.get("after")
        if before is not None and specs.index(before) > specs.index(s):
            a, b = specs.index(before), specs.index(s)
            specs[a], specs[b] = specs[b], specs[a]
    return _write(out, rng, questions, specs, pools)


def _write(out: Path, rng: random.Random, questions: list[dict], specs: list[Spec], pools: dict) -> dict:
    for sub in ("screenshots", "question_screenshots", "haystacks"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "haystacks").mkdir(parents=True)
    nbytes, trajectories = 0, []
    evidence: dict[str, dict] = {q["id"]: {"question_type": q["question_type"], "trajectories": [], "states": [],
                                           "needles": []} for q in questions}
    ids: set[str] = set()
    for s in specs:
        while not s.tid or s.tid in ids:
            s.tid = f"{s.env.domain}_{s.env.slug}_{rng.getrandbits(32):08x}"
        ids.add(s.tid)
        pool = pools[s.env.slug][:10]
        if s.kind in ("view", "edit") and "entity" not in s.args:
            e = rng.choice(pool)
            s.args.update(entity=e, ask=rng.choice(list(s.env.attrs)[:2]), attr=s.env.dyn_attr,
                          new=_distinct(s.env, s.env.dyn_attr, rng, 1, (e[s.env.dyn_attr],))[0])
        b = TrajectoryBuilder(s.env, s.tid, rng)
        for d in s.detours:
            render_detour(b, d, pool)
        goal, outcome = render_main(b, s, pool)
        b.finish()
        trajectories.append({"id": s.tid, "domain": s.env.domain, "goal": goal, "start_url": s.env.url("home"),
                             "outcome": outcome, "states": b.states})
        for k, _ in enumerate(b.states):
            nbytes += write_png(out / "screenshots" / s.tid / f"{k}.png", f"{s.env.app[:10]} {k}")
        for qid, k, needles in b.evidence:
            ev = evidence[qid]
            if s.tid not in ev["trajectories"]:
                ev["trajectories"].append(s.tid)
            ev["states"].append([s.tid, k])
            ev["needles"] += [[s.tid, k, n] for n in needles]
    for q in questions:
        text = q.pop("image_text", None)
        if text:
            q["image"] = f"question_screenshots/{q['id']}.png"
            nbytes += write_png(out / q["image"], text, (160, 24))
    haystacks = {}
    doms = [d for d in ("web", "enterprise") if any(q["domain"] == d for q in questions)]
    for tier, keep in (("small", ("evidence", "small")), ("medium", ("evidence", "small", "medium"))):
        lists = {dom: [s.tid for s in specs if s.env.domain == dom and s.tier in keep] for dom in doms}
        haystacks[tier] = {dom: len(v) for dom, v in lists.items()}
        nbytes += _dump(out / f"haystacks/lme_v2_{tier}.json", {q["id"]: lists[q["domain"]] for q in questions})
    nbytes += _dump_lines(out / "questions.jsonl", questions)
    nbytes += _dump_lines(out / "trajectories.jsonl", trajectories)
    nbytes += _dump(out / EVIDENCE_FILE, evidence)
    per_type = {t: sum(q["question_type"] == t for q in questions) for t in QUESTION_TYPES}
    return {"root": str(out), "questions": len(questions), "per_type": per_type,
            "trajectories": len(trajectories), "states": sum(len(t["states"]) for t in trajectories),
            "evidence_trajectories": len({t for ev in evidence.values() for t in ev["trajectories"]}),
            "haystacks": haystacks, "bytes": nbytes}


def _dump(path: Path, payload) -> int:
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path.stat().st_size


def _dump_lines(path: Path, rows: list[dict]) -> int:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.stat().st_size


def synth_command(out: str, seed: int, small: int, medium: int, per_type: int) -> str:
    """`memexrl lme synth`: write the set and return a one-paragraph summary."""
    s = write_synthetic(Path(out), seed, small, medium, per_type)
    types = ", ".join(f"{n} {t}" for t, n in s["per_type"].items())
    hay = "; ".join(f"{tier}: " + ", ".join(f"{n} {dom}" for dom, n in doms.items())
                    for tier, doms in s["haystacks"].items())
    return (f"Wrote a synthetic LME-V2 set to {s['root']} (seed {seed}): {s['questions']} questions ({types}); "
            f"{s['trajectories']} trajectories with {s['states']} states, {s['evidence_trajectories']} of them "
            f"holding evidence; haystacks shared per domain ({hay} trajectories); {s['bytes'] / 1e6:.2f} MB. "
            f"Load it with `memexrl eval lme --data {s['root']} --haystack small ...`.")
