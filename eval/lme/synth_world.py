"""The invented web environments of the synthetic LME-V2 set, and BrowserGym-style trajectory states.

Three environments (two `web`, one `enterprise`), each a menu of sections and pages, one kind of
entity (products, issues, employees) with fixed and changing attributes, two form procedures
(each with a gotcha: a value the form rejects, its error and the fix) and two features that do
NOT exist (for the procedure-abs premises). `TrajectoryBuilder` turns page visits into states in
the real schema (lme-v2.md "Data layout"): an AXTree of `[id] role 'name'` lines, the action taken
there (`click('a12')`, `fill(...)`, `select_option(...)`, `goto(...)`, `send_msg_to_user(...)`,
null at the last state), a thought and a screenshot path. eval/lme/synth.py plans what is shown.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path


def _pick(*values):
    return lambda rng: rng.choice(values)


@dataclass(frozen=True)
class Env:
    slug: str
    app: str
    domain: str
    base: str
    kind: str                      # the entity kind, e.g. "product"
    names: tuple[tuple[str, ...], tuple[str, ...]]  # entity name = first + " " + second
    attrs: dict                    # attribute label -> value generator (rng -> str), display order
    entity_page: tuple[str, str]   # (section, page) listing the entities
    static_attrs: tuple[str, str]  # never edited
    mc_attr: str                   # categorical, asked as multiple choice
    group_attr: str                # the premise of static-abs questions ("in the X category")
    dyn_attr: str                  # edited by trajectories (dynamic questions)
    menu: dict                     # section -> its pages
    buttons: dict                  # page -> its action buttons
    procedures: tuple[dict, ...]
    fakes: tuple[tuple[str, str, str, str], ...]  # (section, page, missing button, what it would do)
    user: str = "alex.morgan"
    dyn_role: str = "textbox"     # the form control that edits dyn_attr

    @property
    def nav(self) -> tuple[str, ...]:
        return ("Home", *self.menu)

    def url(self, *parts: str) -> str:
        return "/".join([self.base, *(p.lower().replace(" ", "-") for p in parts)])

    def make_entity(self, rng: random.Random, name: str) -> dict:
        return {"name": name, **{label: gen(rng) for label, gen in self.attrs.items()}}


SHOPNOVA = Env(
    "shopnova", "ShopNova Admin", "web", "http://shopnova.example/admin", "product",
    (("Aurora", "Cobalt", "Everest", "Harbor", "Juniper", "Lumen", "Maple", "Nimbus", "Orchid", "Quartz",
      "Sierra", "Willow"),
     ("Desk Lamp", "Kettle", "Backpack", "Throw Pillow", "Water Bottle", "Planter", "Wall Clock", "Yoga Mat",
      "Cutting Board", "Lantern")),
    {"SKU": lambda r: f"SN-{r.randint(1000, 9999)}", "Category": _pick("Lighting", "Kitchen", "Outdoor",
     "Home Decor", "Fitness", "Travel"), "Price": lambda r: f"${r.randint(9, 199)}.99",
     "Quantity": lambda r: str(r.randint(0, 250)), "Weight": lambda r: f"{r.randint(1, 9)}.{r.randint(1, 9)} lbs"},
    ("Catalog", "Products"), ("SKU", "Weight"), "Category", "Category", "Price",
    {"Catalog": ("Products", "Categories"), "Sales": ("Orders", "Credit Memos"),
     "Customers": ("All Customers", "Customer Groups"), "Marketing": ("Cart Price Rules", "Newsletter Queue"),
     "Reports": ("Low Stock", "Search Terms")},
    {"Products": ("Add Product", "Export CSV"), "Orders": ("Create New Order", "Export CSV", "Print Invoices"),
     "Cart Price Rules": ("Add New Rule",), "Customer Groups": ("Add New Group",),
     "Low Stock": ("Refresh Statistics", "Export CSV")},
    (dict(task="create a cart price rule with a coupon code", goal="Create a cart price rule 'Spring Sale {n}' "
          "with coupon code SPRING-SALE-{n} giving 15% off", path=("Marketing", "Cart Price Rules", "Add New Rule"),
          form="New Cart Price Rule", submit="Save Rule",
          fields=(("Rule Name", True, "Spring Sale {n}"), ("Coupon Code", True, "SPRING-SALE-{n}"),
                  ("Discount Percent", True, "15"), ("Description", False, "")),
          bad=("Coupon Code", "SPRING SALE {n}"), error="Coupon code may contain only letters, numbers and dashes.",
          cause="the coupon code contains spaces", fix="replace the spaces in the coupon code with dashes, "
          "e.g. SPRING-SALE-{n}"),
     dict(task="add a new product to the catalog", goal="Add the product 'Nova Travel Mug {n}' priced at 24.99",
          path=("Catalog", "Products", "Add Product"), form="New Product", submit="Save Product",
          fields=(("Product Name", True, "Nova Travel Mug {n}"), ("SKU", True, "SN-NEW-{n}"),
                  ("Price", True, "24.99"), ("Weight", False, "")),
          bad=("Price", "$24.99"), error="Please enter a valid number in the Price field.",
          cause="the price is typed with a dollar sign", fix="type the price as a plain number without the $ "
          "sign, e.g. 24.99")),
    (("Sales", "Orders", "Export to PDF", "export the order grid as a PDF"),
     ("Reports", "Low Stock", "Email Supplier", "email the supplier about a low-stock product")),
)

TASKHIVE = Env(
    "taskhive", "TaskHive", "web", "http://taskhive.example", "issue",
    (("Fix", "Refactor", "Document", "Migrate", "Optimize", "Redesign", "Audit", "Localize", "Test", "Cache"),
     ("login redirect", "invoice export", "search filters", "dark mode toggle", "onboarding emails",
      "API rate limits", "audit log", "billing page", "sprint report", "mobile navbar")),
    {"Key": lambda r: f"TH-{r.randint(100, 999)}", "Project": _pick("Apollo", "Borealis", "Cobalt", "Dune"),
     "Priority": _pick("Low", "Medium", "High", "Urgent"),
     "Status": _pick("To Do", "In Progress", "In Review", "Blocked", "Done"),
     "Assignee": _pick("Priya Nair", "Tom Becker", "Lena Ortiz", "Sam Okafor", "Jin Park"),
     "Story Points": _pick("1", "2", "3", "5", "8", "13")},
    ("Issues", "All Issues"), ("Key", "Story Points"), "Priority", "Project", "Status",
    {"Projects": ("All Projects", "Archived"), "Board": ("Active Sprint", "Sprints"),
     "Issues": ("My Issues", "All Issues"), "Reports": ("Burndown", "Velocity"),
     "Settings": ("Labels", "Members", "Workflows")},
    {"All Issues": ("New Issue", "Bulk Edit"), "Labels": ("New Label",), "Sprints": ("Start Sprint",),
     "Burndown": ("Change Sprint", "Download PNG"), "Members": ("Invite Member", "Remove Member")},
    (dict(task="create a new issue label", goal="Create the label 'needs-design-{n}' for the team",
          path=("Settings", "Labels", "New Label"), form="New Label", submit="Create Label",
          fields=(("Label Name", True, "needs-design-{n}"), ("Color", True, "#D73A4A"),
                  ("Description", False, ""), ("Visible To", True, "All members", "combobox")),
          bad=("Color", "red"), error="Color must be a hex code like #D73A4A.", cause="the color is typed as a name",
          fix="enter the color as a hex code such as #D73A4A instead of a color name"),
     dict(task="start a new sprint", goal="Start sprint 'Sprint {n}' from 2024-03-04 to 2024-03-15",
          path=("Board", "Sprints", "Start Sprint"), form="Start Sprint", submit="Start",
          fields=(("Sprint Name", True, "Sprint {n}"), ("Start Date", True, "2024-03-04"),
                  ("End Date", True, "2024-03-15"), ("Sprint Goal", False, "")),
          bad=("End Date", "2024-02-26"), error="The end date must be later than the start date.",
          cause="the end date is before the start date", fix="set the End Date later than the Start Date")),
    (("Reports", "Burndown", "Export to Gantt", "export the burndown chart as a Gantt chart"),
     ("Settings", "Members", "Transfer Ownership", "transfer project ownership to another member")),
    user="priya.nair", dyn_role="combobox",
)

PEOPLEDESK = Env(
    "peopledesk", "PeopleDesk", "enterprise", "http://peopledesk.corp.example", "employee",
    (("Maya", "Omar", "Grace", "Ivan", "Noor", "Felix", "Hana", "Diego", "Ruth", "Kofi", "Elena", "Arjun"),
     ("Chen", "Haddad", "Lindqvist", "Petrov", "Rahman", "Moreau", "Sato", "Alvarez", "Mensah", "Rossi")),
    {"Employee ID": lambda r: f"E{r.randint(10000, 99999)}", "Department": _pick("Finance", "Legal",
     "Engineering", "Sales", "Facilities", "People Ops"), "Job Title": _pick("Analyst", "Coordinator",
     "Specialist", "Team Lead", "Engineer", "Counsel"),
     "Office": lambda r: f"{r.choice(('North Tower', 'South Tower', 'Annex'))} - Floor {r.randint(2, 14)}",
     "Extension": lambda r: f"x{r.randint(2000, 8999)}"},
    ("Directory", "People"), ("Employee ID", "Extension"), "Job Title", "Department", "Office",
    {"Time Off": ("My Requests", "Team Calendar"), "Directory": ("People", "Org Chart"),
     "Expenses": ("My Reports", "Approvals"), "Payroll": ("Payslips", "Tax Forms")},
    {"People": ("Export Directory",), "My Requests": ("New Request",), "My Reports": ("New Expense",),
     "Payslips": ("Download PDF", "View Year to Date"), "Team Calendar": ("Previous Month", "Next Month")},
    (dict(task="request time off", goal="Request vacation from 2024-07-{d} to 2024-07-{e}",
          path=("Time Off", "My Requests", "New Request"), form="New Time Off Request", submit="Submit Request",
          fields=(("Leave Type", True, "Vacation", "combobox"), ("Start Date", True, "2024-07-{d}"),
                  ("End Date", True, "2024-07-{e}"), ("Comment", False, "")),
          bad=("Start Date", "07/{d}/2024"), error="Dates must be entered as YYYY-MM-DD.",
          cause="the date is typed as MM/DD/YYYY", fix="enter the dates in YYYY-MM-DD format, e.g. 2024-07-{d}"),
     dict(task="submit an expense report", goal="Submit a travel expense of 1250.00 with receipt R-{n}",
          path=("Expenses", "My Reports", "New Expense"), form="New Expense", submit="Submit Expense",
          fields=(("Expense Type", True, "Travel", "combobox"), ("Amount", True, "1250.00"),
                  ("Receipt Number", True, "R-{n}"), ("Cost Center", False, "")),
          bad=("Amount", "1,250.00"), error="Amount must not contain commas.",
          cause="the amount is typed with a thousands separator", fix="enter the amount without commas, "
          "e.g. 1250.00")),
    (("Payroll", "Payslips", "Edit Salary", "change your own salary"),
     ("Time Off", "Team Calendar", "Book Meeting Room", "book a meeting room for the team")),
    user="m.chen",
)

ENVS = (SHOPNOVA, TASKHIVE, PEOPLEDESK)


@dataclass
class Node:
    role: str
    name: str
    depth: int = 0
    props: tuple[str, ...] = ()


def _q(text: str) -> str:
    return "'" + text.replace("'", "\\'") + "'"


@dataclass
class TrajectoryBuilder:
    """Accumulates the states of one trajectory; every action names an element of its own state."""

    env: Env
    tid: str
    rng: random.Random
    states: list[dict] = field(default_factory=list)
    evidence: list[tuple[str, int, list[str]]] = field(default_factory=list)  # (question id, state, needles)

    last: tuple = ()

    def finish(self) -> None:
        """The last state: the page the last action led to, with no action."""
        page, url, content = self.last
        self.add(page, url, content, "The task is finished.", None)

    def add(self, page: str, url: str, content: list[Node], thought: str, act: tuple | None,
            evidence: tuple[str, list[str]] | None = None) -> None:
        """One state: `page` rendered with `content`, then the action `act` (None: the last state).

        act: ("click", name) | ("fill", name, text) | ("select", name, option) | ("goto", url) | ("msg", text).
        """
        nodes = [Node("link", f"{self.env.app} home", 0), Node("navigation", "Main menu", 0),
                 *[Node("link", s, 1) for s in self.env.nav], Node("main", "", 0), Node("heading", page, 1),
                 *[Node(n.role, n.name, n.depth + 1, n.props) for n in content]]
        first = self.rng.randint(10, 400)
        lines, ids = [f"RootWebArea {_q(page + ' | ' + self.env.app)}, focused"], {}
        for i, n in enumerate(nodes):
            bid = f"a{first + i}"
            ids.setdefault(n.name, bid)
            props = "".join(", " + p for p in n.props)
            lines.append("\t" * (n.depth + 1) + f"[{bid}] {n.role} {_q(n.name)}{props}")
        self.last = (page, url, content)
        k = len(self.states)
        action = None
        if act is not None:
            kind, arg, *rest = act
            action = {"click": lambda: f"click('{ids[arg]}')", "goto": lambda: f"goto('{arg}')",
                      "fill": lambda: f"fill('{ids[arg]}', {_q(rest[0])})",
                      "select": lambda: f"select_option('{ids[arg]}', {_q(rest[0])})",
                      "msg": lambda: f"send_msg_to_user({_q(arg)})"}[kind]()
        self.states.append({"url": url, "action": action, "thought": thought, "accessibility_tree": "\n".join(lines),
                            "screenshot": f"screenshots/{self.tid}/{k}.png", "step": k, "state_index": k})
        if evidence is not None:
            self.evidence.append((evidence[0], k, list(evidence[1])))


# ----------------------------------------------------------------------------- page contents

def home_content(env: Env, rng: random.Random) -> list[Node]:
    links = rng.sample([p for pages in env.menu.values() for p in pages], 3)
    return [Node("StaticText", f"Welcome back, {env.user}"),
            Node("StaticText", f"You have {rng.randint(0, 9)} new notifications"),
            Node("region", "Quick links"), *[Node("link", p, 1) for p in links]]


def section_content(env: Env, section: str) -> list[Node]:
    return [Node("StaticText", f"{section}: choose a page"), *[Node("link", p) for p in env.menu[section]]]


def list_content(env: Env, page: str, rows: list[str], *, alert: str = "", search: str = "") -> list[Node]:
    out = [Node("alert", alert)] if alert else []
    out += [Node("searchbox", f"Search {page}", 0, (f"value={_q(search)}",) if search else ()),
            *[Node("button", b) for b in env.buttons.get(page, ("Filters",))],
            Node("table", page), *[Node("link", r, 1) for r in rows],
            Node("StaticText", f"{len(rows)} records found" if rows else "No records found")]
    return out


def detail_content(env: Env, entity: dict, alert: str = "") -> list[Node]:
    out = [Node("alert", alert)] if alert else []
    return out + [Node("StaticText", f"{label}: {entity[label]}") for label in env.attrs] + [
        Node("button", "Edit"), Node("link", f"Back to {env.entity_page[1]}")]


def form_content(fields: list[tuple[str, bool, str, str]], submit: str, alert: str = "") -> list[Node]:
    """fields: (label, required, current value, role)."""
    out = [Node("alert", alert)] if alert else []
    for label, required, value, role in fields:
        props = ((f"value={_q(value)}",) if value else ()) + (("required",) if required else ())
        out.append(Node(role, label, 0, props))
    return out + [Node("button", submit), Node("button", "Cancel")]


def write_png(path: Path, text: str, size: tuple[int, int] = (96, 16)) -> int:
    """A tiny real PNG showing `text`; returns its size in bytes."""
    from PIL import Image, ImageDraw

    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("L", size, 255)
    ImageDraw.Draw(img).text((2, 2), text, fill=0)
    img.save(path, format="PNG", optimize=True)
    return path.stat().st_size
