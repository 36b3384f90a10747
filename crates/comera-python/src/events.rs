//! The loop's events as Python dicts, for a Python callback ([`PyObserver`]), and JSON values
//! as Python objects.

use comera_train::observe::{Control, Event, Observer};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// A JSON value as the Python object `json.loads` would give.
pub fn json_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => {
            let list = PyList::empty(py);
            for x in a {
                list.append(json_to_py(py, x)?)?;
            }
            list.into_any()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// An event as JSON: `{"kind": …, …}`; a record keeps the fields it has in `metrics.jsonl`.
pub fn event_json(event: &Event<'_>) -> Value {
    match event {
        Event::Started { total, step, lr } => {
            json!({"kind": "started", "total": total, "step": step, "lr": lr})
        }
        Event::EpochStarted {
            epoch,
            phase,
            phases,
        } => json!({"kind": "epoch_started", "epoch": epoch, "phase": phase, "phases": phases}),
        Event::Step { step } => json!({"kind": "step", "step": step}),
        Event::Record(r) => serde_json::to_value(r).unwrap_or(Value::Null),
        Event::Checkpoint { step, path } => {
            json!({"kind": "checkpoint", "step": step, "path": path.display().to_string()})
        }
        Event::Message(text) => json!({"kind": "message", "text": text}),
        Event::TrainingEnded => json!({"kind": "training_ended"}),
        Event::Finished(s) => json!({"kind": "finished", "summary": s}),
        _ => json!({"kind": "other"}),
    }
}

/// Hands every event to a Python callable (`callback(event_dict)`; returning the string
/// `"stop"` or `False` stops the run after the step, with a checkpoint). An exception raised
/// by the callback, or a Ctrl-C seen by the waiting thread ([`PyObserver::stop_with`]), stops
/// the run the same way and is raised once the run has ended.
pub struct PyObserver {
    callback: Option<Py<PyAny>>,
    raised: Arc<Mutex<Option<PyErr>>>,
}

impl PyObserver {
    pub fn new(callback: Option<Py<PyAny>>) -> (PyObserver, Arc<Mutex<Option<PyErr>>>) {
        let raised = Arc::new(Mutex::new(None));
        (
            PyObserver {
                callback,
                raised: raised.clone(),
            },
            raised,
        )
    }

    /// Keeps the first exception; the run stops.
    fn raise(&self, e: PyErr) -> Control {
        PyObserver::stop_with(&self.raised, e);
        Control::Stop
    }

    /// Asks the run that `raised` belongs to to stop at its next event, and keeps `e` (the
    /// first exception only) to raise when it has ended.
    pub fn stop_with(raised: &Mutex<Option<PyErr>>, e: PyErr) {
        let mut slot = raised.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

impl Observer for PyObserver {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        if self
            .raised
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return Control::Stop;
        }
        let Some(cb) = &self.callback else {
            return Control::Continue;
        };
        Python::attach(|py| {
            let answer = json_to_py(py, &event_json(event)).and_then(|ev| cb.call1(py, (ev,)));
            match answer {
                Err(e) => self.raise(e),
                Ok(v) => {
                    let v = v.bind(py);
                    let stop = v.extract::<bool>().is_ok_and(|b| !b)
                        || v.extract::<String>().is_ok_and(|s| s == "stop");
                    if stop {
                        Control::Stop
                    } else {
                        Control::Continue
                    }
                }
            }
        })
    }
}
