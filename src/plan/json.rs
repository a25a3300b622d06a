//! Checked reads of config.json fields: every number finite, integral where it
//! must be, in range; every error names the file and the field.

use serde_json::{Map, Value};
use std::fmt;

/// A config problem, always naming the file and the field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}: field `{}`: {}", self.file, self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// A JSON object together with the file it came from, for error messages.
pub struct Fields<'a> {
    pub file: &'a str,
    pub obj: &'a Map<String, Value>,
    /// Prefix for nested objects, e.g. `quantization_config.`.
    pub prefix: String,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

impl<'a> Fields<'a> {
    pub fn new(file: &'a str, root: &'a Value) -> Result<Self, ConfigError> {
        match root {
            Value::Object(obj) => Ok(Fields {
                file,
                obj,
                prefix: String::new(),
            }),
            other => Err(ConfigError {
                file: file.into(),
                field: String::new(),
                message: format!(
                    "expected a JSON object at the top level, found {}",
                    describe(other)
                ),
            }),
        }
    }

    pub fn err(&self, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.into(),
            field: format!("{}{}", self.prefix, field),
            message: message.into(),
        }
    }

    /// The value of `field`, treating JSON null as absent.
    pub fn get(&self, field: &str) -> Option<&'a Value> {
        match self.obj.get(field) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn nested(&self, field: &str) -> Result<Option<Fields<'a>>, ConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                file: self.file,
                obj,
                prefix: format!("{}{}.", self.prefix, field),
            })),
            Some(v) => Err(self.err(field, format!("expected an object, found {}", describe(v)))),
        }
    }

    fn number_to_u64(
        &self,
        field: &str,
        v: &Value,
        min: u64,
        max: u64,
    ) -> Result<u64, ConfigError> {
        let n = match v {
            Value::Number(n) => n,
            other => {
                return Err(self.err(
                    field,
                    format!("expected an integer, found {}", describe(other)),
                ))
            }
        };
        let value = if let Some(u) = n.as_u64() {
            u
        } else if let Some(i) = n.as_i64() {
            return Err(self.err(field, format!("expected an integer >= {min}, found {i}")));
        } else {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if !f.is_finite() || f.fract() != 0.0 {
                return Err(self.err(field, format!("expected an integer, found {n}")));
            }
            if f < 0.0 || f > u64::MAX as f64 {
                return Err(self.err(
                    field,
                    format!("expected an integer in {min}..={max}, found {n}"),
                ));
            }
            f as u64
        };
        if value < min || value > max {
            return Err(self.err(
                field,
                format!("expected an integer in {min}..={max}, found {value}"),
            ));
        }
        Ok(value)
    }

    /// An integer field in `min..=max`; `default` when absent (None = required).
    pub fn uint(
        &self,
        field: &str,
        default: Option<u64>,
        min: u64,
        max: u64,
    ) -> Result<u64, ConfigError> {
        match self.get(field) {
            Some(v) => self.number_to_u64(field, v, min, max),
            None => default.ok_or_else(|| self.err(field, "required field is missing")),
        }
    }

    pub fn usize(
        &self,
        field: &str,
        default: Option<usize>,
        min: usize,
        max: usize,
    ) -> Result<usize, ConfigError> {
        self.uint(field, default.map(|d| d as u64), min as u64, max as u64)
            .map(|v| v as usize)
    }

    pub fn opt_usize(
        &self,
        field: &str,
        min: usize,
        max: usize,
    ) -> Result<Option<usize>, ConfigError> {
        match self.get(field) {
            Some(v) => self
                .number_to_u64(field, v, min as u64, max as u64)
                .map(|v| Some(v as usize)),
            None => Ok(None),
        }
    }

    /// A finite float in `min..=max`.
    pub fn float(
        &self,
        field: &str,
        default: Option<f64>,
        min: f64,
        max: f64,
    ) -> Result<f64, ConfigError> {
        let v = match self.get(field) {
            Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
            Some(other) => {
                return Err(self.err(
                    field,
                    format!("expected a number, found {}", describe(other)),
                ))
            }
            None => return default.ok_or_else(|| self.err(field, "required field is missing")),
        };
        if !v.is_finite() || v < min || v > max {
            return Err(self.err(
                field,
                format!("expected a finite number in [{min}, {max}], found {v}"),
            ));
        }
        Ok(v)
    }

    pub fn opt_float(&self, field: &str, min: f64, max: f64) -> Result<Option<f64>, ConfigError> {
        if self.get(field).is_none() {
            return Ok(None);
        }
        self.float(field, None, min, max).map(Some)
    }

    pub fn boolean(&self, field: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(field) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(self.err(
                field,
                format!("expected true or false, found {}", describe(other)),
            )),
            None => Ok(default),
        }
    }

    pub fn string(&self, field: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(field) {
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.err(
                field,
                format!("expected a string, found {}", describe(other)),
            )),
            None => Ok(None),
        }
    }

    /// A list of integers, each in `min..=max`.
    pub fn usize_list(
        &self,
        field: &str,
        min: usize,
        max: usize,
    ) -> Result<Option<Vec<usize>>, ConfigError> {
        match self.get(field) {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    self.number_to_u64(&format!("{field}[{i}]"), v, min as u64, max as u64)
                        .map(|u| u as usize)
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(self.err(
                field,
                format!("expected a list of integers, found {}", describe(other)),
            )),
            None => Ok(None),
        }
    }

    /// A token id or a list of them (`eos_token_id` may be either), each
    /// below `vocab`.
    pub fn token_ids(&self, field: &str, vocab: usize) -> Result<Vec<u32>, ConfigError> {
        let max = vocab.saturating_sub(1);
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(_)) => Ok(self
                .usize_list(field, 0, max)?
                .unwrap_or_default()
                .into_iter()
                .map(|v| v as u32)
                .collect()),
            Some(_) => Ok(vec![self.usize(field, None, 0, max)? as u32]),
        }
    }
}
