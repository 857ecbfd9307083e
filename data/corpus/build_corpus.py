"""Rebuild this folder's corpus from the shared copies of its sources (how the bundled files were made).

    python data/corpus/build_corpus.py --source /work/shared/data/corpus --out data/corpus

Writes `gutenberg/{train,valid}.jsonl.gz` and `tinystories/{train,valid}.jsonl.gz` (one JSON
record per document: `{"source", "title", "text"}`), each source's `SOURCE.txt` and licence files.
The output is byte-for-byte deterministic (gzip mtime 0, fixed book list, no randomness).

Cleaning, in the order it is applied (README.md says why):

- Gutenberg: keep the text between the `*** START OF` and `*** END OF` markers; drop illustration
  tags, footnote marks and `_italics_` underscores; drop paragraphs with no lowercase letter
  (headings), short paragraphs without closing punctuation (titles, "by ..."), list-like blocks
  (tables of contents) and anything naming Project Gutenberg; re-flow hard-wrapped prose into one
  line per paragraph (verse keeps its lines); ASCII quotes and dashes.
- TinyStories: the uploader lowercased it, so it is re-cased: mojibake repaired, each word takes
  the case Gutenberg uses for it mid-sentence when Gutenberg mostly capitalises it ("I", "Tom",
  "Mr"), character names introduced with "named X" are capitalised, and sentence starts are
  capitalised. Names that are also common words ("lily" the flower) may stay lowercase.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path

# Held out whole: validation measures prose the model has not seen, not memorised passages.
GUTENBERG_VALID = (
    "Baum_L_Frank_Lyman_Frank/Little_Wizard_Stories_of_Oz.txt",
    "Burnett_Frances_Hodgson/Racketty_Packetty_House_as_Told_by_Queen_Crosspatch.txt",
    "Lang_Andrew/The_Princess_Nobody_A_Tale_of_Fairyland.txt",
)
GUTENBERG_TRAIN = (
    "Alcott_Louisa_May/Flower_Fables.txt",
    "Alcott_Louisa_May/Little_Men_Life_at_Plumfield_with_Jo_s_Boys.txt",
    "Andersen_H_C_Hans_Christian/Hans_Andersen_s_Fairy_Tales_First_Series.txt",
    "Andersen_H_C_Hans_Christian/Hans_Andersen_s_Fairy_Tales_Second_Series.txt",
    "Barrie_J_M_James_Matthew/Peter_Pan_in_Kensington_Gardens.txt",
    "Barrie_J_M_James_Matthew/Peter_and_Wendy.txt",
    "Baum_L_Frank_Lyman_Frank/Dorothy_and_the_Wizard_in_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/Ozma_of_Oz_A_Record_of_Her_Adventures_with_Dorothy_Gale_of_Kansas_the_Yellow_Hen_the_Scare.txt",
    "Baum_L_Frank_Lyman_Frank/Rinkitink_in_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Emerald_City_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Lost_Princess_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Magic_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Marvelous_Land_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Patchwork_Girl_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Road_to_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Scarecrow_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/The_Tin_Woodman_of_Oz_A_Faithful_Story_of_the_Astonishing_Adventure_Undertaken_by_the_Tin_.txt",
    "Baum_L_Frank_Lyman_Frank/The_Wonderful_Wizard_of_Oz.txt",
    "Baum_L_Frank_Lyman_Frank/Tik_Tok_of_Oz.txt",
    "Burnett_Frances_Hodgson/A_Little_Princess_Being_the_whole_story_of_Sara_Crewe_now_told_for_the_first_time.txt",
    "Burnett_Frances_Hodgson/The_Secret_Garden.txt",
    "Carroll_Lewis/Alice_s_Adventures_in_Wonderland.txt",
    "Grimm_Jacob/Grimms_Fairy_Tales.txt",
    "Kipling_Rudyard/Just_So_Stories.txt",
    "Kipling_Rudyard/The_Jungle_Book.txt",
    "Kipling_Rudyard/The_Second_Jungle_Book.txt",
    "Lang_Andrew/The_Blue_Fairy_Book.txt",
    "Lang_Andrew/The_Green_Fairy_Book.txt",
    "Lang_Andrew/The_Grey_Fairy_Book.txt",
    "Lang_Andrew/The_Pink_Fairy_Book.txt",
    "Lang_Andrew/The_Red_Fairy_Book.txt",
    "Lang_Andrew/The_Violet_Fairy_Book.txt",
    "Lang_Andrew/The_Yellow_Fairy_Book.txt",
    "Montgomery_L_M_Lucy_Maud/Anne_of_Avonlea.txt",
    "Montgomery_L_M_Lucy_Maud/Anne_of_Green_Gables.txt",
    "Nesbit_E_Edith/The_Wouldbegoods.txt",
    "Nesbit_E_Edith/Wet_Magic.txt",
    "Nesbit_E_Edith/The_Phoenix_and_the_Carpet.txt",
    "Nesbit_E_Edith/The_Railway_Children.txt",
    "Nesbit_E_Edith/The_Story_of_the_Amulet.txt",
    "Nesbit_E_Edith/The_Story_of_the_Treasure_Seekers_Being_the_Adventures_of_the_Bastable_Children_in_Search_.txt",
)
TINYSTORIES_FILE = "train_head_lowercased.txt"
TINYSTORIES_VALID_STORIES = 200  # the last stories of the file are held out

ASCII_PUNCTUATION = {"“": '"', "”": '"', "‘": "'", "’": "'", "—": "--", "–": "-", "…": "...", "\u00a0": " "}
# UTF-8 punctuation decoded as cp1252 and then lowercased by the uploader: "â€œ" was “.
MOJIBAKE = {"â€œ": '"', "â€\x9d": '"', "â€™": "'", "â€˜": "'", "â€”": "--", "â€“": "-", "â€¦": "..."}
DETERMINERS = frozenset(
    ["a", "an", "the", "some", "his", "her", "my", "your", "our", "their", "this", "that", "its"]
)
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")  # contractions and possessives are one word


# ---------------------------------------------------------------- Gutenberg


def strip_gutenberg_boilerplate(raw: str, name: str) -> str:
    """The text between the `*** START OF` and `*** END OF` marker lines."""
    lines = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, line in enumerate(lines) if re.match(r"\*\*\* ?START OF", line)), None)
    end = next((i for i, line in enumerate(lines) if re.match(r"\*\*\* ?END OF", line)), None)
    if start is None or end is None or end <= start:
        raise ValueError(f"{name}: no '*** START OF' / '*** END OF' markers")
    return "\n".join(lines[start + 1 : end])


def _keep_paragraph(lines: list[str]) -> bool:
    text = " ".join(lines)
    if not re.search(r"[a-z]", text) or re.search(r"gutenberg|transcriber|produced by|e-text", text, re.I):
        return False
    if len(text) < 40 and not re.search(r"[.!?\"':;,]$", text):
        return False  # titles, chapter names, "by L. Frank Baum"
    short = sum(len(line.strip()) < 50 for line in lines)
    closed = sum(bool(re.search(r"[.!?\"':;,\-)]$", line)) for line in lines)
    return len(lines) < 3 or short < 0.8 * len(lines) or closed >= 0.3 * len(lines)  # else a contents list


def _reflow(lines: list[str]) -> str:
    """Prose becomes one line; verse (short or indented lines) keeps its line breaks."""
    verse = len(lines) > 1 and all(len(line) < 50 for line in lines[:-1])
    verse = verse or sum(line.startswith("  ") for line in lines) > len(lines) // 2
    stripped = [re.sub(r"\s+", " ", line).strip() for line in lines]
    return "\n".join(stripped) if verse else " ".join(stripped)


def clean_gutenberg(raw: str, name: str) -> str:
    text = strip_gutenberg_boilerplate(raw, name)
    for old, new in ASCII_PUNCTUATION.items():
        text = text.replace(old, new)
    text = re.sub(r"\[(Illustration|Footnote)[^\]]*\]", "", text, flags=re.S)
    text = re.sub(r"\[\d+\]|\{\d+\}", "", text)  # footnote marks
    text = re.sub(r"_([^_]+)_", r"\1", text)  # _italics_
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if lines and not re.fullmatch(r"[\s*.]+", " ".join(lines)) and _keep_paragraph(lines):
            paragraphs.append(_reflow(lines))
    return "\n\n".join(paragraphs)


def mid_sentence_case_counts(texts: list[str]) -> dict[str, Counter[str]]:
    """lowercase word -> Counter of the forms Gutenberg writes it in, away from sentence starts."""
    counts: dict[str, Counter[str]] = {}
    for text in texts:
        for match in re.finditer(rf"(?<=[a-z,;] ){WORD.pattern}", text):  # after a word or a comma
            word = match.group()
            counts.setdefault(word.lower(), Counter())[word] += 1
    return counts


# ---------------------------------------------------------------- TinyStories


def split_stories(raw: str) -> list[str]:
    """Stories are separated by a single newline; paragraphs inside a story by a blank line."""
    for old, new in {**MOJIBAKE, **ASCII_PUNCTUATION}.items():
        raw = raw.replace(old, new)
    stories = [s.strip() for s in re.split(r"(?<=\S)\n(?=\S)", raw) if s.strip()]
    if stories and not re.search(r"[.!?\"]$", stories[-1]):
        stories.pop()  # the file is a head of the dataset: its last story may be cut
    return [s for s in stories if s.isascii()]  # a few stories keep unrepairable mojibake


def truecase_table(stories: list[str], gutenberg_case: dict[str, Counter[str]]) -> dict[str, str]:
    """lowercase word -> the form to write it in (only words that change).

    A word is re-cased only if TinyStories hardly ever puts it after a determiner ("the button",
    "a lily"): that keeps Gutenberg's character names ("Button-Bright") off common nouns.
    """
    text = "\n".join(stories)
    total = Counter(WORD.findall(text))
    after_determiner = Counter(
        m.group(2) for m in re.finditer(rf"\b([a-z]+) ({WORD.pattern})", text) if m.group(1) in DETERMINERS
    )
    common = {w for w, _ in Counter({w: c[w] for w, c in gutenberg_case.items()}).most_common(300)}

    def name_like(word: str) -> bool:
        return after_determiner[word] < 0.05 * total[word]

    table = {}
    for lower, forms in gutenberg_case.items():
        form, count = forms.most_common(1)[0]
        n = sum(forms.values())
        if form != lower and count > n / 2 and n >= 3 and name_like(lower):
            table[lower] = form  # "i" -> "I", "i'm" -> "I'm", "tom" -> "Tom", "mr" -> "Mr"
    for word, n in Counter(re.findall(r"\bnamed ([a-z]+)", text)).items():
        # "a girl named lily" often, and hardly ever "a lily": a character's name. ("named true" once
        # among 80 "true"s is not.)
        if n >= 2 and n >= 0.03 * total[word] and word not in common and name_like(word):
            table[word] = word.capitalize()
    return table


def truecase(story: str, table: dict[str, str]) -> str:
    def recase(match: re.Match[str]) -> str:
        word = match.group()
        if word in table:
            return table[word]
        base, possessive, rest = word.partition("'")
        return table[base] + possessive + rest if possessive and rest == "s" and base in table else word

    story = WORD.sub(recase, story)
    # Sentence starts: the story's start, after . ! ? (and after a closing quote only for `."`, since
    # `"Hi!" said Tom` keeps its lowercase), and an opening quote.
    starts = r'(^|[.!?]\s+|\."\s+|(?:^|\s)")([a-z])'
    return re.sub(starts, lambda m: m.group(1) + m.group(2).upper(), story)


# ---------------------------------------------------------------- output


def write_jsonl_gz(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for record in records:
            gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_gutenberg(source: Path, out: Path) -> list[str]:
    manifest = json.loads((source / "MANIFEST.json").read_text())
    entries = {f["file"]: f for f in manifest["files"]}
    note = [
        "gutenberg/{train,valid}.jsonl.gz: one JSON record per book, the Project Gutenberg header and",
        "footer stripped (only the text between the '*** START OF' and '*** END OF' lines is kept), then",
        "cleaned and re-flowed by build_corpus.py. Whole books are held out for validation.",
        "",
        f"Source: {manifest['repo']}@{manifest['commit']}:<orig_path>",
        "via /work/shared/data/corpus/gutenberg_childrens (its MANIFEST.json maps files to orig_path).",
        "",
        "split | orig_path | git blob | raw bytes | characters kept",
    ]
    texts = {}
    for split, books in (("train", GUTENBERG_TRAIN), ("valid", GUTENBERG_VALID)):
        records = []
        for book in books:
            entry = entries[book]
            text = clean_gutenberg((source / book).read_text(encoding="utf-8", errors="replace"), book)
            title = Path(entry["orig_path"]).stem.replace("\r", " ")
            records.append({"source": "gutenberg", "title": title, "text": text})
            note.append(
                f"{split} | {entry['orig_path']!r} | {entry['blob']} | {entry['bytes']} | {len(text)}"
            )
            texts[book] = text
        write_jsonl_gz(out / "gutenberg" / f"{split}.jsonl.gz", records)
    note.append("")
    note.append("License: public domain in the US (Project Gutenberg eBooks); see LICENSE.txt.")
    (out / "gutenberg" / "SOURCE.txt").write_text("\n".join(note) + "\n")
    shutil.copyfile(source / "REPO_README.md", out / "gutenberg" / "REPO_README.md")
    return [texts[book] for book in GUTENBERG_TRAIN]


def build_tinystories(source: Path, out: Path, gutenberg_train: list[str]) -> None:
    raw = (source / TINYSTORIES_FILE).read_text(encoding="utf-8")
    stories = split_stories(raw)
    table = truecase_table(stories, mid_sentence_case_counts(gutenberg_train))
    stories = [truecase(s, table) for s in stories]
    split_at = len(stories) - TINYSTORIES_VALID_STORIES
    for split, part in (("train", stories[:split_at]), ("valid", stories[split_at:])):
        records = [{"source": "tinystories", "title": "", "text": s} for s in part]
        write_jsonl_gz(out / "tinystories" / f"{split}.jsonl.gz", records)
    digest = hashlib.sha256(raw.encode()).hexdigest()
    note = f"""\
tinystories/{{train,valid}}.jsonl.gz: {len(stories)} TinyStories stories, one JSON record each.

CHANGED FILES (CDLA-Sharing-1.0, section 3.1(b)): these files are modified TinyStories data. From
{TINYSTORIES_FILE} ({len(raw.encode())} bytes, sha256 {digest}), build_corpus.py
repaired cp1252 mojibake of quotes and dashes, dropped stories still not ASCII and a possibly
cut last story, and re-cased the text (the upstream copy is lowercased): {len(table)} words take
the case Gutenberg gives them or are character names, and sentence starts are capitalised.
The last {TINYSTORIES_VALID_STORIES} stories form the validation split; the rest are train.

Upstream note of the shared copy:
"""
    (out / "tinystories" / "SOURCE.txt").write_text(note + (source / "SOURCE.txt").read_text())
    # The data's licence text (LICENSE-CDLA-Sharing-1.0.txt) is kept in the output folder itself.
    shutil.copyfile(source / "REPO_LICENSE_Arnoochka", out / "tinystories" / "REPO_LICENSE_Arnoochka")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=Path("/work/shared/data/corpus"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    gutenberg_train = build_gutenberg(args.source / "gutenberg_childrens", args.out)
    build_tinystories(args.source / "tinystories", args.out, gutenberg_train)
    for path in sorted(args.out.rglob("*.jsonl.gz")):
        print(f"{path.relative_to(args.out)}  {path.stat().st_size:>9,d} bytes  sha256 {sha256(path)[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
