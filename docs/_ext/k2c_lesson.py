"""Lesson admonitions in the style of sphinx-lesson, without the dependency.

``:::{exercise}``, ``:::{objectives}``, ``:::{solution}`` … render as
admonitions titled with the directive's name (or the directive's argument, if
given) and carrying the directive's name as a CSS class, so the site's
stylesheet can colour them. Lecture notebooks and guide pages use the same
names, which keeps them portable to a real sphinx-lesson site.
"""
from __future__ import annotations

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.parsers.rst.directives.admonitions import BaseAdmonition

#: directive name -> default title
LESSON_ADMONITIONS = {
    "objectives": "Objectives",
    "prerequisites": "Prerequisites",
    "prereq": "Prerequisites",
    "questions": "Questions",
    "keypoints": "Keypoints",
    "exercise": "Exercise",
    "exercises": "Exercises",
    "challenge": "Challenge",
    "solution": "Solution",
    "discussion": "Discussion",
    "demo": "Demo",
    "type-along": "Type-along",
    "homework": "Homework",
    "checklist": "Checklist",
    "callout": "Callout",
    "instructor-note": "Instructor note",
    "output": "Output",
}


class LessonAdmonition(BaseAdmonition):
    """An admonition whose title defaults to the directive's own name."""

    node_class = nodes.admonition
    required_arguments = 0
    optional_arguments = 1
    final_argument_whitespace = True
    has_content = True
    option_spec = {"class": directives.class_option, "name": directives.unchanged}

    def run(self):
        default = LESSON_ADMONITIONS.get(self.name, self.name.replace("-", " ").capitalize())
        self.arguments = [self.arguments[0] if self.arguments else default]
        self.options = dict(self.options)
        self.options["class"] = [self.name, "lesson"] + list(self.options.get("class", []))
        return super().run()


def setup(app):
    for name in LESSON_ADMONITIONS:
        app.add_directive(name, LessonAdmonition)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
