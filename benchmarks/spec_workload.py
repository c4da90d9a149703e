"""The prompts of `spec_decode.py`: data only.

`GROUNDED` tasks are answered mostly by repeating their own input (copy a paragraph, edit a
function, convert a table, fix spelling): the case that prompt-lookup (ngram) speculation is
made for. `FREE_FORM` prompts have no text to copy: there speculation must not cost much.
Each task is a user message, sent after `SYSTEM` through the model's chat template, and the
most tokens it may generate (greedy; the model stops at its end-of-turn token).
"""

from __future__ import annotations

# Without it SmolLM2-135M wraps an edited passage in comments on its changes, or answers a
# table conversion with a Python script.
SYSTEM = "You are a careful editor. Reply with only the requested text, with no explanation."

GROUNDED: list[dict[str, object]] = [
    # ---- copy a paragraph verbatim ---------------------------------------------------------
    {
        "name": "copy-lighthouse",
        "kind": "copy",
        "max_tokens": 256,
        "prompt": """Copy the following paragraph exactly, word for word. Do not add anything.

The lighthouse at the end of the northern breakwater was built in 1874 from granite blocks \
quarried twelve miles inland and carried to the coast on flat wagons pulled by oxen. For \
more than eighty years a keeper lived in the small stone cottage at its foot, climbing the \
ninety-two steps of the tower every evening to trim the wick and wind the clockwork that \
turned the lens. The light could be seen from nineteen miles out at sea on a clear night, \
and sailors returning from the fishing grounds used it to find the narrow channel between \
the sandbanks. In 1957 the lamp was electrified and the last keeper moved to the town, but \
the cottage still stands, and every summer volunteers open it to visitors who want to see \
the brass instruments, the logbooks and the keeper's narrow iron bed.""",
    },
    {
        "name": "copy-printing-press",
        "kind": "copy",
        "max_tokens": 256,
        "prompt": """Repeat the text below verbatim, exactly as it is written.

Before the printing press, every book in Europe was copied by hand, usually by monks working \
in the scriptoria of monasteries. A single Bible could take a skilled scribe more than a \
year to finish, and the parchment alone required the skins of hundreds of animals. When \
Johannes Gutenberg began printing with movable metal type in Mainz around 1450, he did not \
only make books faster; he made them cheaper and more alike. Two readers in different cities \
could now point to the same line on the same page. Within fifty years, printing shops had \
opened in more than two hundred towns, and millions of books were in circulation. Scholars \
argue about how quickly ordinary people learned to read, but few doubt that the press \
changed how ideas spread.""",
    },
    {
        "name": "copy-meeting-note",
        "kind": "copy",
        "max_tokens": 256,
        "prompt": """Please copy this note exactly as written, keeping every line.

Team meeting notes, Tuesday 14 March

Attendees: Maria, Jonas, Priya, Tom and Alex.

1. The new release is planned for the first week of April. Jonas will prepare the release \
notes and send them to everyone by Friday.
2. Priya reported that the test servers were slow last week because the disk was almost \
full. She has removed old log files and added an alert for when the disk is more than \
eighty percent full.
3. Tom asked whether we can move the weekly meeting from Tuesday to Wednesday morning. \
Everyone agreed to try it for one month.
4. Maria will contact the customer about the delayed invoice and report back at the next \
meeting.

Next meeting: Wednesday 22 March at 10:00 in room 4B.""",
    },
    # ---- edit code and return the whole function -------------------------------------------
    {
        "name": "code-rename",
        "kind": "code",
        "max_tokens": 320,
        "prompt": '''Rename the variable `lst` to `items` everywhere in this Python function. \
Return the whole function.

```python
def summarize(lst, key=None):
    """Return the count, total, mean, smallest and largest value of lst."""
    if not lst:
        return {"count": 0, "total": 0, "mean": None, "min": None, "max": None}
    if key is not None:
        lst = [key(x) for x in lst]
    total = 0
    smallest = lst[0]
    largest = lst[0]
    for value in lst:
        total += value
        if value < smallest:
            smallest = value
        if value > largest:
            largest = value
    count = len(lst)
    return {
        "count": count,
        "total": total,
        "mean": total / count,
        "min": smallest,
        "max": largest,
    }
```''',
    },
    {
        "name": "code-add-parameter",
        "kind": "code",
        "max_tokens": 320,
        "prompt": '''Add a parameter `timeout=10` to this function and pass it to \
`urllib.request.urlopen`. Return the whole function.

```python
import json
import urllib.request


def fetch_json(url, retries=3, headers=None):
    """Download url and parse its body as JSON, retrying on errors."""
    request = urllib.request.Request(url, headers=headers or {})
    last_error = None
    for attempt in range(retries):
        try:
            with urllib.request.urlopen(request) as response:
                body = response.read().decode("utf-8")
                return json.loads(body)
        except (OSError, ValueError) as error:
            last_error = error
            print(f"attempt {attempt + 1} of {retries} failed: {error}")
    raise RuntimeError(f"could not fetch {url}") from last_error
```''',
    },
    {
        "name": "code-fix-bug",
        "kind": "code",
        "max_tokens": 320,
        "prompt": '''This function should return the moving average of `values` over a window \
of `size` elements, but the last window is missing from the result. Fix the bug and return \
the whole function.

```python
def moving_average(values, size):
    """Return the averages of every run of size consecutive values."""
    if size <= 0:
        raise ValueError("size must be positive")
    if size > len(values):
        return []
    averages = []
    window_sum = sum(values[:size])
    averages.append(window_sum / size)
    for i in range(size, len(values) - 1):
        window_sum += values[i]
        window_sum -= values[i - size]
        averages.append(window_sum / size)
    return averages


def main():
    prices = [10, 11, 12, 13, 12, 11, 10, 9, 10, 12]
    for size in (2, 3, 5):
        print(size, moving_average(prices, size))
```''',
    },
    # ---- convert a table -------------------------------------------------------------------
    {
        "name": "table-markdown-to-csv",
        "kind": "table",
        "max_tokens": 256,
        "prompt": """Convert this markdown table to CSV. Keep the header row.

| city | country | population | area_km2 |
|---|---|---|---|
| Lisbon | Portugal | 545000 | 100 |
| Madrid | Spain | 3300000 | 604 |
| Paris | France | 2100000 | 105 |
| Berlin | Germany | 3700000 | 891 |
| Vienna | Austria | 1900000 | 414 |
| Prague | Czechia | 1300000 | 496 |
| Warsaw | Poland | 1800000 | 517 |
| Oslo | Norway | 700000 | 454 |
| Dublin | Ireland | 590000 | 117 |
| Athens | Greece | 640000 | 39 |""",
    },
    {
        "name": "table-csv-to-markdown",
        "kind": "table",
        "max_tokens": 320,
        "prompt": """Convert this CSV data to a markdown table.

name,department,start_date,salary
Alice Martin,Engineering,2019-04-01,82000
Bruno Silva,Marketing,2020-09-15,61000
Chen Wei,Engineering,2018-01-10,91000
Dana Cohen,Finance,2021-06-01,70000
Erik Larsen,Support,2017-11-20,52000
Fatima Khan,Engineering,2022-02-14,78000
George Brown,Sales,2016-05-30,66000
Hana Sato,Finance,2019-08-19,73000""",
    },
    {
        "name": "table-markdown-to-json",
        "kind": "table",
        "max_tokens": 384,
        "prompt": """Convert this markdown table to a JSON list of objects, one object per \
row, using the column names as keys.

| id | product | price | in_stock |
|---|---|---|---|
| 101 | notebook | 2.50 | true |
| 102 | pencil | 0.80 | true |
| 103 | stapler | 7.99 | false |
| 104 | scissors | 4.25 | true |
| 105 | glue stick | 1.60 | true |
| 106 | ruler | 1.20 | false |""",
    },
    # ---- fix spelling and return the passage -----------------------------------------------
    {
        "name": "spelling-garden",
        "kind": "spelling",
        "max_tokens": 256,
        "prompt": """Fix the spelling mistakes in this passage. Return the corrected passage.

Every spring my grandmother planted tomatos, beens and letuce in the small garden behind \
her house. She beleived that the soil needed to rest, so each year she moved the vegetables \
to a diferent corner. In the evenings she would sit on the bench by the fence and listen to \
the birds while the sun went down. She told me that a garden teaches paitence, because \
nothing you plant today will be ready tommorow. When I was a child I did not understand \
what she ment, but now that I have my own garden I think about her words every time I kneel \
in the dirt and wait for the first green leafs to apear.""",
    },
    {
        "name": "spelling-announcement",
        "kind": "spelling",
        "max_tokens": 256,
        "prompt": """Correct the spelling in the following text and return the whole \
corrected text.

Dear residents, we would like to remind everyone that the anual cleaning of the building \
will take place next Saterday. Please remove all bicycles, shoes and other personal \
belongings from the hallways and the staircase before eight o'clock in the morning. The \
cleaning company will also wash the windows in the comon areas, so the main entrence will \
be closed for about two ours. If you have any questions or need help moving heavy items, \
please contact the building manager by email or leave a mesage in the office. Thank you for \
your cooperation and for helping us keep the building clean and safe for everyone.""",
    },
    {
        "name": "spelling-science",
        "kind": "spelling",
        "max_tokens": 256,
        "prompt": """Fix all spelling errors in this paragraph and give me the corrected \
paragraph.

Photosynthesis is the proces by which green plants use the energy of sunlight to turn water \
and carbon dioxide into sugar and oxygen. It takes place mainly in the leafs, inside small \
structures called chloroplasts, which contain a green pigment named chlorophyl. The sugar \
made during photosynthesis gives the plant the energy it needs to grow, and the oxygen is \
released into the air throught tiny openings in the leaf. Almost all life on Earth depends \
on this proccess, either directly or indirectly, because animals eat plants or eat other \
animals that have eaten plants.""",
    },
]

FREE_FORM: list[dict[str, object]] = [
    {
        "name": "chat-exercise",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "What are some good ways to stay active when you work at a desk all day?",
    },
    {
        "name": "chat-story",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "Write a short story about a robot who learns to bake bread.",
    },
    {
        "name": "chat-seasons",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "Why does the Earth have seasons?",
    },
    {
        "name": "chat-learn-language",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "I want to learn Spanish in my free time. How should I start?",
    },
    {
        "name": "chat-python",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "What is the difference between a list and a tuple in Python?",
    },
    {
        "name": "chat-trip",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "Suggest a plan for a relaxing weekend in the mountains.",
    },
    {
        "name": "chat-sleep",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "Give me some tips for sleeping better at night.",
    },
    {
        "name": "chat-history",
        "kind": "chat",
        "max_tokens": 128,
        "prompt": "Tell me about the history of the bicycle.",
    },
]
